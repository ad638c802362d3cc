"""The NVFP4 format: pure PyTorch numerics, no DeepSpeed. The only package that knows the bit layout."""

from .constants import BLOCK_SIZE, BLOCKS, E2M1_MAX, E2M1_VALUES, E4M3_MAX, RHT_SIGNS, ROUNDINGS
from .hadamard import hadamard, inverse_hadamard, rht_matrix
from .quantize import dequantize, quantize, quantize_values
from .scaling import STANDARD, WeightScaling
from .storage import NVFP4Storage

__all__ = [
    "BLOCKS",
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "RHT_SIGNS",
    "ROUNDINGS",
    "STANDARD",
    "NVFP4Storage",
    "WeightScaling",
    "dequantize",
    "hadamard",
    "inverse_hadamard",
    "quantize",
    "quantize_values",
    "rht_matrix",
]
