"""`NVFP4Linear`: an ``nn.Linear`` whose GEMMs run in FP4 (see ops.py for the numerics)."""

from __future__ import annotations

import torch
from torch import nn

from .module import FP4Module, running_max
from .ops import fp4_linear_tracked
from .recipe import Recipe
from .weights import WeightCodes


def fp4_forward(module: FP4Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                codes: WeightCodes, *, param: torch.Tensor | None = None, index: int | None = None,
                stored_kn: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One FP4 GEMM of ``module``: ``x [..., K] @ weight.T + bias`` with ``weight`` ``[N, K]``.

    ``param``: the parameter whose storage and version counter identify the weight's values (default ``weight``):
    a 3-D experts parameter (``weight`` is its expert ``index``), or a Conv1D's ``[K, N]`` parameter (``weight`` is
    its transpose; with ``stored_kn`` the stored layout is quantized as it is and its 16x16 codes transposed, which
    is exact, so the BF16 weight is never copied). The codes are reused or quantized (``WeightCodes``). Returns
    ``(out, max|x|)`` (float32 0-dim, NaN when ``x`` held NaN/Inf) and flags a non-finite training step."""
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    recipe = module.recipe
    param = weight if param is None else param
    reused = codes.reuse(param, index=index, gathered_ok=not recipe.act_hadamard)  # gathered codes are of W
    fresh = reused is None
    amax = codes.amax(index) if fresh or module.stats.capture else None
    if fresh:
        codes.quantizations += 1
        if stored_kn:
            from ..format import quantize

            # weight.t(): the stored, contiguous layout
            q = quantize(weight.t(), block="16x16", amax=amax, scaling=recipe.weight).t()
            reused = (q.data, q.scale, q.amax)
            codes.keep(param, reused, index)
    if module.stats.capture:
        module.stats.observe_forward(x, weight, recipe, amax)
    # max|x| and the output's non-finite flag come from the quantizer and the GEMM epilogue (no extra passes)
    out, seen, out_bad, got = fp4_linear_tracked(x, weight, bias, recipe, amax, out_dtype, reused)
    if fresh and not stored_kn:
        codes.keep(param, got, index)
    if module.training:
        module._flag(seen, out_bad)
    if module.stats.capture and out.requires_grad:
        out.register_hook(module.stats.observe_grad)
    return out, seen


class NVFP4Linear(FP4Module, nn.Linear):
    """Same parameters, state_dict keys and constructor as ``nn.Linear``; checkpoints and optimizers see a Linear.

    Shapes: input ``[..., in_features]`` (any leading size, tokens need not be a multiple of 16), weight
    ``[out_features, in_features]`` with ``in_features % 16 == 0`` (and ``out_features % 16 == 0`` for 16x16
    weight blocks); any input dtype (BF16 or FP32), works under ``torch.autocast`` (the output takes the
    autocast dtype).
    """

    kind = "Linear"
    #: where the weight's codes come from in a forward: reuse, the agreed or fused amax (nn/weights.py)
    weight_codes: WeightCodes
    #: running max of the finite |input| over training forwards (FP32 scalar; None before the first): the static
    #: activation scale a W4A4 export needs (``ds-nvfp4 export``), agreed across ranks when a checkpoint is saved
    input_amax: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: Recipe | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_fp4(recipe or Recipe())

    def _init_fp4(self, recipe: Recipe) -> None:
        super()._init_fp4(recipe)
        self.weight_codes = WeightCodes()
        self.input_amax = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe) -> NVFP4Linear:
        """Turn ``linear`` into an NVFP4Linear in place: the same object, Parameters and hooks (ZeRO-3 safe)."""
        return cls.convert(linear, recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_only:
            return nn.Linear.forward(self, x)
        out, seen = fp4_forward(self, x, self.weight, self.bias, self.weight_codes)
        if self.training:
            self.input_amax = running_max(self.input_amax, seen.detach())
        return out

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"{super().extra_repr()}, nvfp4(weights={r.weight_block}, backward={r.backward_gemm}, "
                f"kernel={r.kernel})")
