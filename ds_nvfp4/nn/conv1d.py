"""FP4 GEMMs for GPT-2-style ``Conv1D`` (transformers.pytorch_utils): a Linear whose weight is stored ``[in, out]``.

The class is recognised by its shape contract, not imported (transformers is optional): a module named ``Conv1D``
with ``nf`` (out), ``nx`` (in), ``weight [nx, nf]`` and ``bias [nf]``, whose forward is ``x @ weight + bias``.
The GEMM needs the weight as ``[out, in]`` quantized along ``in``; with 16x16 weight tiles the stored ``[in, out]``
layout is quantized as it is and its codes transposed (tiles are closed under transposition: exactly the codes of
the transposed weight), so the BF16 weight is never copied. 1x16 weight blocks run along the stored last dim
(``out``), so a Conv1D stays BF16 under them, with that reason; so it does with RHT (it rotates along ``in``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .linear import fp4_forward
from .module import FP4Module, running_max
from .recipe import Recipe
from .weights import WeightCodes


def is_conv1d(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and hasattr(m, "nf") and hasattr(m, "nx")
            and tuple(getattr(w, "ds_shape", w.shape)) == (m.nx, m.nf))


def conv1d_blocker(m: nn.Module, recipe: Recipe) -> str | None:
    """Why this Conv1D cannot run FP4 GEMMs, or None."""
    if recipe.weight_block != "16x16":
        return ("Conv1D stores its weight [in, out]: 1x16 weight blocks would run along out, not along the GEMM's K; "
                'use precision.weights.block "16x16"')
    if recipe.act_hadamard:
        return "Conv1D with activations.hadamard (RHT along in) is not supported: its weight is stored [in, out]"
    if m.nx % 16 or m.nf % 16:
        return f"Conv1D nx={m.nx}, nf={m.nf}: both must be multiples of 16 (16x16 weight tiles)"
    return None


class FP4Conv1D(FP4Module):
    """Mixed into a Conv1D instance (``convert`` swaps its class): same parameters, keys and layout."""

    kind = "Conv1D"
    weight_codes: WeightCodes
    input_amax: torch.Tensor | None

    def _init_fp4(self, recipe: Recipe) -> None:
        super()._init_fp4(recipe)
        self.weight_codes = WeightCodes(transposed=True)
        self.input_amax = None

    @classmethod
    def convert(cls, module: nn.Module, recipe: Recipe):
        return FP4Module.convert.__func__(_fp4_class(type(module)), module, recipe)

    @property
    def in_features(self) -> int:
        return self.nx

    @property
    def out_features(self) -> int:
        return self.nf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_only:
            return super().forward(x)
        out, seen = fp4_forward(self, x, self.weight.t(), self.bias, self.weight_codes, param=self.weight,
                                stored_kn=True)
        if self.training:
            self.input_amax = running_max(self.input_amax, seen.detach())
        return out


@functools.cache
def _fp4_class(base: type) -> type:
    return type(f"NVFP4{base.__name__}", (FP4Conv1D, base), {})
