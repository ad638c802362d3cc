"""The one interface every FP4 GEMM backend implements.

All GEMMs are "TN": ``mm(a, b) = a @ b.T`` with ``a`` ``[M, K]`` and ``b`` ``[N, K]``, both quantized along K
(their last dim), which is the only layout the FP4 tensor cores take. The nn layer builds Fprop, Dgrad and
Wgrad out of it by choosing which tensors to quantize along which dimension.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..format import NVFP4Tensor
from ..format.constants import GLOBAL_SCALE_NUMERATOR


class GemmBackend(ABC):
    """A way to multiply two NVFP4 tensors. Stateless; one instance per process is enough."""

    name: str

    @abstractmethod
    def mm(self, a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``a @ b.T`` as ``out_dtype`` ``[M, N]``: FP32 accumulation, both per-tensor decode scales applied."""


def global_alpha(a: NVFP4Tensor, b: NVFP4Tensor) -> torch.Tensor:
    """float32 0-dim ``amax_a * amax_b / 2688^2``: the product of the two per-tensor decode scales.

    cuBLASLt receives exactly this as ``alpha`` (the note: ``amax_A * amax_B / (36 * 448^2)``); every backend
    applies it to the FP32 accumulator in the same order so their outputs agree.
    """
    inv = torch.tensor(1.0 / (GLOBAL_SCALE_NUMERATOR * GLOBAL_SCALE_NUMERATOR), dtype=torch.float32,
                       device=a.amax.device)
    return (a.amax * b.amax) * inv


def check_operands(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"FP4 GEMM needs a [M, K] and b [N, K] with the same K; got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
