"""The optimizer seam of packed ZeRO-3 storage, and :func:`install`, which sets the storage up on an engine."""

from __future__ import annotations

from ..nn.recipe import Recipe
from ..nn.weights import WeightCodes
from .gather import install_gather_hooks
from .packed import FrozenSource, PackedPartitions


class PackedStorageOptimizerMixin:
    """Mixed into the engine's ZeRO-3 optimizer instance (``opt.__class__ = type(..., (Mixin, type(opt)), {})``):
    after each sub-group step the partition is re-quantized from the FP32 master (instead of DeepSpeed's FP32 -> BF16
    copy); checkpoint loading runs DeepSpeed's own code on a temporary flat BF16 layout and re-packs from the
    loaded FP32 master. (ZeRO-3's optimizer class may be swapped: only BF16_Optimizer is compared by type.)"""

    _ds_nvfp4_store: PackedPartitions

    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        store = self._ds_nvfp4_store
        if not store.packed:
            return super()._reassign_or_swap_out_partitioned_parameters(sub_group_id)
        store.pack_group(sub_group_id)

    def load_state_dict(self, *args, **kwargs):
        with self._ds_nvfp4_store.flat_layout():
            return super().load_state_dict(*args, **kwargs)

    def _restore_from_bit16_weights(self):
        with self._ds_nvfp4_store.flat_layout():
            return super()._restore_from_bit16_weights()

    def load_module_checkpoint_state_from_checkpoint_dir_stage3(self, *args, **kwargs):
        with self._ds_nvfp4_store.flat_layout():
            return super().load_module_checkpoint_state_from_checkpoint_dir_stage3(*args, **kwargs)


def install(engine, names: dict[int, str], converted: dict[int, WeightCodes], recipe: Recipe, all_gather: str,
            fused: list[list[int]] | None = None, frozen_sources: dict[int, FrozenSource] | None = None,
            frozen_described: str = "") -> PackedPartitions:
    """Pack the engine's converted ZeRO-3 weights and hook DeepSpeed (called by ``ds_nvfp4.initialize``).

    ``recipe``: the layers' weight quantization (block, scaling) that the partitions reproduce bit for bit;
    ``fused`` lists groups of parameter ids (weights of one fused inference GEMM) that share one amax.
    Converted weights that do not train (a frozen base) are packed once, from ``frozen_sources`` where given (their
    stored codes, e.g. a published checkpoint's, ``frozen_described`` saying which) or from their BF16 partitions.
    """
    opt = engine.optimizer
    store = PackedPartitions(engine, names, converted, recipe, all_gather, fused)
    base = type(opt)
    opt.__class__ = type(f"NVFP4{base.__name__}", (PackedStorageOptimizerMixin, base), {})
    opt._ds_nvfp4_store = store
    opt._partition_all_parameters()
    store.pack_all()
    store.pack_frozen(frozen_sources, frozen_described)
    install_gather_hooks(store)
    # persistent parameters still hold their pre-packing BF16 values: the forward must see the packed weight
    store.refresh_persistent()
    return store
