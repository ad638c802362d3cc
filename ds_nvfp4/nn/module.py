"""`FP4Module`: what every NVFP4 GEMM module shares (``NVFP4Linear``, ``NVFP4Conv1D``, ``NVFP4Experts``).

A converted module keeps its class's parameters, state_dict keys, hooks and forward signature; this mixin adds the
recipe, the per-weight :class:`~ds_nvfp4.nn.WeightCodes`, the statistics hook and the running facts the engine reads
(the input amax a W4A4 export needs, the non-finite flag of the last step).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .recipe import Recipe
from .stats import LayerStats
from .weights import WeightCodes

#: what a module kind is called in reports ("Linear", "Conv1D", "experts")
KINDS = ("Linear", "Conv1D", "experts")


class FP4Module:
    """Mixed into a converted module. ``kind`` is its report name; :meth:`fp4_weights` lists its GEMM weights."""

    kind = "Linear"
    recipe: Recipe
    #: the recipe from the config; ``recipe`` differs from it while ``precision.schedule`` runs GEMMs in BF16
    base_recipe: Recipe
    #: every GEMM of this module in BF16 (its class's own forward): set by :meth:`set_gemm_precision`
    bf16_only: bool
    #: whether a training forward since the last optimizer step saw a non-finite input or output (bool scalar
    #: tensor, no host sync; read by the engine's non-finite guard to name the first culprit module)
    nonfinite: torch.Tensor | None

    def _init_fp4(self, recipe: Recipe) -> None:
        self.recipe = self.base_recipe = recipe
        self.bf16_only = False
        self.stats = LayerStats()
        self.nonfinite = None

    @classmethod
    def convert(cls, module: nn.Module, recipe: Recipe):
        """Turn ``module`` into this class in place: the same object, Parameters and hooks (ZeRO-3 safe)."""
        module.__class__ = cls
        module._init_fp4(recipe)
        return module

    def fp4_weights(self) -> list[tuple[str, nn.Parameter, WeightCodes]]:
        """``(attribute name, parameter, its WeightCodes)`` of every weight this module multiplies in FP4."""
        return [("weight", self.weight, self.weight_codes)]

    def set_gemm_precision(self, forward_fp4: bool, backward_fp4: bool) -> None:
        """Which GEMMs run in FP4 from the next forward on (``precision.schedule``; the recipe's own choices are the
        upper bound: a recipe with a BF16 backward stays BF16 there). No FP4 GEMM left: the class's own forward."""
        base = self.base_recipe
        backward_fp4 = backward_fp4 and base.backward_gemm == "nvfp4"
        self.bf16_only = not forward_fp4 and not backward_fp4
        self.recipe = dataclasses.replace(base, forward_gemm="nvfp4" if forward_fp4 else "bf16",
                                          backward_gemm="nvfp4" if backward_fp4 else "bf16")
        for _, _, codes in self.fp4_weights():
            codes.invalidate()

    @property
    def weight_quantizations(self) -> int:
        """How many times this module quantized a weight (every forward GEMM that could not reuse codes)."""
        return sum(codes.quantizations for _, _, codes in self.fp4_weights())

    def _flag(self, seen: torch.Tensor, out_bad: torch.Tensor) -> None:
        """Training forwards: remember whether the input (``seen``: its max |x|, NaN if non-finite) or the output
        was non-finite since the last optimizer step."""
        bad = ~torch.isfinite(seen) | out_bad
        self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad


def running_max(current: torch.Tensor | None, seen: torch.Tensor) -> torch.Tensor:
    """The running max of the finite values of ``seen`` (a non-finite step must not poison an export scale)."""
    finite = torch.where(torch.isfinite(seen), seen, torch.zeros_like(seen))
    return finite if current is None else torch.maximum(current, finite)
