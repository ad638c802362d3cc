"""Non-finite values in training: the error, and which FP4 layers saw them first."""

from __future__ import annotations

from torch import nn

from .module import FP4Module


class NonFiniteError(FloatingPointError):
    """A step's gradients (or a master weight) held NaN/Inf. Raised on every rank; the FP32 masters and the
    optimizer state are those of the last good step, so the last checkpoint and a save right after are clean."""


def nonfinite_layers(module: nn.Module, read: bool = True) -> list[str]:
    """NVFP4 layers whose training forwards since the last call saw a non-finite input or output, in module
    order (for a sequential model, the first is where the values went bad first); resets the flags. One host
    sync when ``read``; none otherwise (a step that was not skipped only needs the reset)."""
    import torch

    layers = [(n, m) for n, m in module.named_modules() if isinstance(m, FP4Module) and m.nonfinite is not None]
    flags = torch.stack([m.nonfinite for _, m in layers]).cpu().tolist() if (read and layers) else []
    for _, m in layers:
        m.nonfinite = None
    return [n for (n, _), bad in zip(layers, flags) if bad]
