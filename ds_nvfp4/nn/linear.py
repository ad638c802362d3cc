"""`NVFP4Linear`: an ``nn.Linear`` whose GEMMs run in FP4 (see ops.py for the numerics)."""

from __future__ import annotations

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

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: Recipe | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_fp4(recipe or Recipe())

    def _init_fp4(self, recipe: Recipe) -> None:
        self.recipe = recipe
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
