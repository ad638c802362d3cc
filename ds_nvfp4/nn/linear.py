"""`NVFP4Linear`: an ``nn.Linear`` whose GEMMs run in FP4 (see ops.py for the numerics)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .ops import fp4_linear_tracked
from .recipe import Recipe
from .stats import LayerStats
from .weights import WeightCodes


class NVFP4Linear(nn.Linear):
    """Same parameters, state_dict keys and constructor as ``nn.Linear``; checkpoints and optimizers see a Linear.

    Shapes: input ``[..., in_features]`` (any leading size, tokens need not be a multiple of 16), weight
    ``[out_features, in_features]`` with ``in_features % 16 == 0`` (and ``out_features % 16 == 0`` for 16x16
    weight blocks); any input dtype (BF16 or FP32), works under ``torch.autocast`` (the output takes the
    autocast dtype).
    """

    recipe: Recipe
    #: where the weight's codes come from in a forward: reuse, the agreed or fused amax (nn/weights.py)
    weight_codes: WeightCodes
    #: running max of the finite |input| over training forwards (FP32 scalar; None before the first): the static
    #: activation scale a W4A4 export needs (``ds-nvfp4 export``), agreed across ranks when a checkpoint is saved
    input_amax: torch.Tensor | None
    #: whether a training forward since the last optimizer step saw a non-finite input or output (bool scalar
    #: tensor, no host sync; read by the engine's non-finite guard to name the first culprit layer)
    nonfinite: torch.Tensor | None
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
        self.weight_codes = WeightCodes()
        self.input_amax = None
        self.nonfinite = None

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
        self.weight_codes.invalidate()

    @property
    def weight_quantizations(self) -> int:
        """How many times this layer quantized its weight (every forward that could not reuse codes)."""
        return self.weight_codes.quantizations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_only:
            return super().forward(x)
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        wc = self.weight_codes
        # gathered codes are of W; an RHT layer multiplies H(W), so it quantizes again
        reused = wc.reuse(self.weight, gathered_ok=not self.recipe.act_hadamard)
        amax = wc.amax() if reused is None or self.stats.capture else None
        if reused is None:
            wc.quantizations += 1
        if self.stats.capture:
            self.stats.observe_forward(x, self.weight, self.recipe, amax)
        # max|x| and the output's non-finite flag come from the quantizer and the GEMM epilogue (no extra passes)
        out, seen, out_bad, codes = fp4_linear_tracked(x, self.weight, self.bias, self.recipe, amax, out_dtype,
                                                       reused)
        if reused is None:
            wc.keep(self.weight, codes)
        if self.training:
            ok = torch.isfinite(seen)
            finite = torch.where(ok, seen, torch.zeros_like(seen))  # a bad step must not poison the export scale
            self.input_amax = finite if self.input_amax is None else torch.maximum(self.input_amax, finite)
            bad = ~ok | out_bad
            self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad
        if self.stats.capture and out.requires_grad:
            out.register_hook(self.stats.observe_grad)
        return out

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"{super().extra_repr()}, nvfp4(weights={r.weight_block}, backward={r.backward_gemm}, "
                f"kernel={r.kernel})")
