"""`emulated`: an exact emulation of the FP4 tensor-core GEMM, on any device.

Each operand is expanded to ``e2m1 * e4m3`` values (exact in float32: at most 2 + 4 significant bits), the
product is accumulated in float32, and the two per-tensor decode scales are applied to the accumulator, as
cuBLASLt's ``alpha`` does. On CPU float32 matmuls are ~4.5x faster than bf16 ones (no AVX512-BF16/AMX) and
exact for these operands, so the emulation is as fast as plain BF16 training here.
"""

from __future__ import annotations

import torch

from ..format import NVFP4Tensor
from .base import GemmBackend, check_operands, global_alpha


class EmulatedBackend(GemmBackend):
    name = "emulated"

    def mm(self, a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        check_operands(a, b)
        acc = a.block_values() @ b.block_values().t()
        return (acc * global_alpha(a, b)).to(out_dtype)
