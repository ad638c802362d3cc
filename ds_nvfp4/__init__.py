"""ds-nvfp4: NVFP4 pretraining under DeepSpeed ZeRO.

Layers, each importing only the ones before it:
``format`` (numerics) <- ``kernels`` (GEMM backends) <- ``nn`` (modules, conversion) <- ``zero``
(DeepSpeed storage) <- ``engine`` (``initialize``); ``config`` and ``cli`` beside them.
"""

from .config import ConfigError, PrecisionConfig, load_config
from .format import NVFP4Tensor, dequantize, hadamard, inverse_hadamard, quantize
from .nn import ConversionReport, NVFP4Linear, convert_model

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ConversionReport",
    "NVFP4Linear",
    "NVFP4Tensor",
    "PrecisionConfig",
    "__version__",
    "convert_model",
    "dequantize",
    "hadamard",
    "inverse_hadamard",
    "load_config",
    "quantize",
]
