"""NVFP4 modules: the FP4 Linear (autograd + custom ops), model conversion and its report, statistics."""

from .blocks import Blocks, find_blocks
from .convert import convert_model
from .linear import NVFP4Linear
from .nonfinite import NonFiniteError, nonfinite_layers
from .ops import fp4_linear
from .recipe import Recipe
from .report import ConversionReport, LayerDecision
from .stats import StatsCollector, tensor_stats
from .weights import FusedGroup, WeightCodes

__all__ = ["Blocks",
           "ConversionReport",
           "FusedGroup",
           "LayerDecision",
           "NVFP4Linear",
           "NonFiniteError",
           "Recipe",
           "StatsCollector",
           "WeightCodes",
           "convert_model",
           "find_blocks",
           "fp4_linear",
           "nonfinite_layers",
           "tensor_stats",
]
