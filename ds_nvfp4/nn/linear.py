"""`NVFP4Linear`: an ``nn.Linear`` whose GEMMs run in FP4 (see ops.py for the numerics)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .ops import fp4_linear_tracked
from .recipe import Recipe
from .stats import LayerStats

#: Bumped after every optimizer step (``ds_nvfp4.initialize``'s step wrapper) and checkpoint load: a cached weight
#: quantization from an older generation is stale. See :func:`invalidate_weight_caches`.
_generation = 0


def invalidate_weight_caches() -> None:
    """Drop every NVFP4Linear's cached weight codes (call after changing weights outside an optimizer step of a
    ``ds_nvfp4.initialize`` engine; in-place changes through the parameter itself are noticed anyway)."""
    global _generation
    _generation += 1


#: Attribute the ZeRO store hangs on a weight parameter: the float32 amax agreed across data-parallel ranks,
#: so the forward re-derives exactly the stored codes from the gathered BF16 weight.
WEIGHT_AMAX_ATTR = "ds_nvfp4_amax"
#: Attribute the ZeRO store sets on a weight while it is gathered with ``all_gather: "nvfp4"``: the full weight's
#: NVFP4 codes ``((data_ptr, _version) of the weight then, (data [N, K/2] uint8, scale e4m3, amax float32 0-dim))``
#: as they arrived. They are exactly what
#: quantizing the gathered weight with its agreed amax gives (the exactness invariant of docs/zero.md), so the
#: forward uses them instead of quantizing again. Removed when the weight is released.
GATHERED_CODES_ATTR = "ds_nvfp4_gathered_codes"


class NVFP4Linear(nn.Linear):
    """Same parameters, state_dict keys and constructor as ``nn.Linear``; checkpoints and optimizers see a Linear.

    Shapes: input ``[..., in_features]`` (any leading size, tokens need not be a multiple of 16), weight
    ``[out_features, in_features]`` with ``in_features % 16 == 0`` (and ``out_features % 16 == 0`` for 16x16
    weight blocks); any input dtype (BF16 or FP32), works under ``torch.autocast`` (the output takes the
    autocast dtype).
    """

    recipe: Recipe
    #: sibling layers sharing this layer's weight amax (``precision.modules.fuse``; set by convert_model)
    fused_peers: tuple[NVFP4Linear, ...]
    #: running max of the finite |input| over training forwards (FP32 scalar; None before the first): the static
    #: activation scale a W4A4 export needs (``ds-nvfp4 export``), agreed across ranks when a checkpoint is saved
    input_amax: torch.Tensor | None
    #: whether a training forward since the last optimizer step saw a non-finite input or output (bool scalar
    #: tensor, no host sync; read by ``ds_nvfp4.initialize``'s step wrapper to name the first culprit layer)
    nonfinite: torch.Tensor | None
    #: quantize the weight once per optimizer step and reuse the codes in the step's other forwards (gradient
    #: accumulation, activation-checkpointing recomputation, evaluation). Off by default: only an engine that bumps
    #: the generation after each optimizer step (``ds_nvfp4.initialize``, ZeRO-0/1/2) turns it on.
    cache_weight: bool
    #: how many times this layer quantized its weight (cache misses included; every forward without the cache)
    weight_quantizations: int
    #: the recipe from the config; ``recipe`` differs from it while ``precision.schedule`` runs GEMMs in BF16
    base_recipe: Recipe
    #: every GEMM of this layer in BF16 (``nn.Linear``'s own forward and backward): set by :meth:`set_gemm_precision`
    bf16_only: bool

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: Recipe | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_fp4(recipe or Recipe())

    def _init_fp4(self, recipe: Recipe) -> None:
        self.recipe = self.base_recipe = recipe
        self.bf16_only = False
        self.stats = LayerStats()
        self.fused_peers = ()
        self.input_amax = None
        self.nonfinite = None
        self.cache_weight = False
        self.weight_quantizations = 0
        self._weight_cache: tuple[tuple, tuple[torch.Tensor, ...]] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe) -> NVFP4Linear:
        """Turn ``linear`` into an NVFP4Linear in place: the same object, Parameters and hooks (ZeRO-3 safe)."""
        linear.__class__ = cls
        linear._init_fp4(recipe)
        return linear  # type: ignore[return-value]

    def set_gemm_precision(self, forward_fp4: bool, backward_fp4: bool) -> None:
        """Which GEMMs run in FP4 from the next forward on (``precision.schedule``; the recipe's own choices are the
        upper bound: a recipe with a BF16 backward stays BF16 there). No FP4 GEMM left: ``nn.Linear``'s forward."""
        base = self.base_recipe
        backward_fp4 = backward_fp4 and base.backward_gemm == "nvfp4"
        self.bf16_only = not forward_fp4 and not backward_fp4
        self.recipe = dataclasses.replace(base, forward_gemm="nvfp4" if forward_fp4 else "bf16",
                                          backward_gemm="nvfp4" if backward_fp4 else "bf16")
        self._weight_cache = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_only:
            return super().forward(x)
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        cached, key = None, None
        if self.cache_weight:
            # the generation covers DeepSpeed's writes through flat buffers (they bypass the parameter's version
            # counter); data_ptr and _version cover in-place changes through the parameter itself
            w = self.weight
            key = (_generation, w.data_ptr(), w._version, tuple(w.shape), w.dtype)
            if self._weight_cache is not None and self._weight_cache[0] == key:
                cached = self._weight_cache[1]
        gathered = getattr(self.weight, GATHERED_CODES_ATTR, None)
        # not with RHT (it quantizes H(W), the codes are of W), nor after the gathered weight was changed in place
        if cached is None and gathered is not None and not self.recipe.act_hadamard and \
                gathered[0] == (self.weight.data_ptr(), self.weight._version):
            cached = gathered[1]
        amax = None
        if cached is None:
            self.weight_quantizations += 1
        if cached is None or self.stats.capture:
            amax = getattr(self.weight, WEIGHT_AMAX_ATTR, None)
            if amax is None and self.fused_peers:
                amax = self.shared_weight_amax()
        if self.stats.capture:
            self.stats.observe_forward(x, self.weight, self.recipe, amax)
        # max|x| and the output's non-finite flag come from the quantizer and the GEMM epilogue (no extra passes)
        out, seen, out_bad, codes = fp4_linear_tracked(x, self.weight, self.bias, self.recipe, amax, out_dtype,
                                                       cached)
        if self.cache_weight and cached is None:
            self._weight_cache = (key, tuple(c.detach() for c in codes))
        elif not self.cache_weight:
            self._weight_cache = None
        if self.training:
            ok = torch.isfinite(seen)
            finite = torch.where(ok, seen, torch.zeros_like(seen))  # a bad step must not poison the export scale
            self.input_amax = finite if self.input_amax is None else torch.maximum(self.input_amax, finite)
            bad = ~ok | out_bad
            self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad
        if self.stats.capture and out.requires_grad:
            out.register_hook(self.stats.observe_grad)
        return out

    def shared_weight_amax(self) -> torch.Tensor:
        """The max of |W| over this layer and its fused peers (FP32 scalar): the one global scale an inference
        engine's fused GEMM has. Needs every member's full weight (ZeRO-0/1/2 or no DeepSpeed; under ZeRO-3 the
        packed store agrees on the group's amax instead)."""
        members = (self, *self.fused_peers)
        if any(m.weight.numel() != m.in_features * m.out_features for m in members):
            raise RuntimeError(f"{type(self).__name__}: a fused peer's weight is partitioned (ZeRO-3 without packed "
                               "storage): its amax cannot be read in this forward; ds_nvfp4.initialize unfuses such "
                               "groups, convert_model cannot know")
        return torch.stack([m.weight.detach().abs().amax().float() for m in members]).max()

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"{super().extra_repr()}, nvfp4(weights={r.weight_block}, backward={r.backward_gemm}, "
                f"kernel={r.kernel})")
