"""`NVFP4Linear`: an ``nn.Linear`` whose GEMMs run in FP4 (see ops.py for the numerics)."""

from __future__ import annotations

import torch
from torch import nn

from .ops import fp4_linear
from .recipe import Recipe
from .stats import LayerStats

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

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: Recipe | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_fp4(recipe or Recipe())

    def _init_fp4(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.stats = LayerStats()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe) -> NVFP4Linear:
        """Turn ``linear`` into an NVFP4Linear in place: the same object, Parameters and hooks (ZeRO-3 safe)."""
        linear.__class__ = cls
        linear._init_fp4(recipe)
        return linear  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        amax = getattr(self.weight, WEIGHT_AMAX_ATTR, None)
        if self.stats.capture:
            self.stats.observe_forward(x, self.weight, self.recipe, amax)
        out = fp4_linear(x, self.weight, self.bias, self.recipe, amax, out_dtype)
        if self.stats.capture and out.requires_grad:
            out.register_hook(self.stats.observe_grad)
        return out

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"{super().extra_repr()}, nvfp4(weights={r.weight_block}, backward={r.backward_gemm}, "
                f"kernel={r.kernel})")
