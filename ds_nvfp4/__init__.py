"""ds-nvfp4: NVFP4 pretraining under DeepSpeed ZeRO.

Layers, each importing only the ones before it:
``format`` (numerics) <- ``kernels`` (GEMM backends) <- ``nn`` (modules, conversion) <- ``zero``
(DeepSpeed storage) <- ``engine`` (``initialize``); ``config`` and ``cli`` beside them.
"""

from . import data
from .config import ConfigError, PrecisionConfig, load_config
from .format import NVFP4Tensor, dequantize, hadamard, inverse_hadamard, quantize, quantize_values
from .nn import ConversionReport, NonFiniteError, NVFP4Linear, convert_model


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize``; see :func:`ds_nvfp4.engine.initialize`."""
    from .engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def storage_report(engine):
    """Per-rank NVFP4 storage report of an engine; see :func:`ds_nvfp4.engine.storage_report`."""
    from .engine import storage_report as _storage_report

    return _storage_report(engine)

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "ConversionReport", "NVFP4Linear", "NVFP4Tensor", "NonFiniteError", "PrecisionConfig", "__version__",
    "convert_model", "data", "dequantize", "hadamard", "initialize", "inverse_hadamard", "load_config", "quantize",
    "quantize_values",
    "storage_report",
]
