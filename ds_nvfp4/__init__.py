"""ds-nvfp4: NVFP4 pretraining under DeepSpeed ZeRO.

Layers, each importing only the ones before it (docs/architecture.md; tests/test_layers.py checks it):
``format`` (numerics) <- ``kernels`` (GEMM backends) <- ``nn`` (modules, conversion) <- ``zero`` (DeepSpeed
storage and its seams) <- ``engine`` (``initialize`` and the lifecycle); ``config``, ``checkpoint``, ``export`` and
``cli`` beside them. The evaluation tooling (``ds_nvfp4.evaluation``) sits on top and is not imported here.
"""

from ._version import __version__
from .config import ConfigError, PrecisionConfig, load_config
from .format import NVFP4Storage, dequantize, hadamard, inverse_hadamard, quantize, quantize_values
from .nn import ConversionReport, NonFiniteError, NVFP4Linear, convert_model


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize``; see :func:`ds_nvfp4.engine.initialize`."""
    from .engine import initialize as _initialize

    return _initialize(*args, **kwargs)


def storage_report(engine):
    """Per-rank NVFP4 storage report of an engine; see :func:`ds_nvfp4.engine.storage_report`."""
    from .engine import storage_report as _storage_report

    return _storage_report(engine)


def __getattr__(name: str):
    if name == "NVFP4Tensor":  # the 0.1.0 name of NVFP4Storage (it is a storage dataclass, not a torch.Tensor)
        import warnings

        warnings.warn("ds_nvfp4.NVFP4Tensor is now ds_nvfp4.NVFP4Storage (a storage dataclass, not a "
                      "torch.Tensor subclass)", DeprecationWarning, stacklevel=2)
        return NVFP4Storage
    raise AttributeError(f"module 'ds_nvfp4' has no attribute {name!r}")


__all__ = [
    "ConfigError", "ConversionReport", "NVFP4Linear", "NVFP4Storage", "NonFiniteError", "PrecisionConfig",
    "__version__", "convert_model", "dequantize", "hadamard", "initialize", "inverse_hadamard", "load_config",
    "quantize", "quantize_values", "storage_report",
]
