"""NVFP4 modules: the FP4 Linear (autograd + custom ops), model conversion and its report, statistics."""

from .convert import convert_model, find_blocks
from .linear import WEIGHT_AMAX_ATTR, NVFP4Linear
from .nonfinite import NonFiniteError, nonfinite_layers
from .ops import fp4_linear
from .recipe import Recipe
from .report import ConversionReport, LayerDecision
from .stats import StatsCollector, tensor_stats

__all__ = ["WEIGHT_AMAX_ATTR", "ConversionReport", "LayerDecision", "NVFP4Linear", "NonFiniteError", "Recipe",
           "StatsCollector", "convert_model", "find_blocks", "fp4_linear", "nonfinite_layers", "tensor_stats"]
