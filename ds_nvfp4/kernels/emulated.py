"""`emulated`: the FP4 tensor-core GEMM on any device, with exact products and FP32 accumulation.

Each operand is expanded to block values ``e2m1 * e4m3`` (at most 2 + 4 significant bits: exact in BF16, TF32 and
FP32) and handed to the device's fastest exact-operand GEMM (kernels/operand.py): BF16 where the device has BF16
matrix units (CPUs with AVX512-BF16/AMX, CUDA tensor cores), FP32 elsewhere. The library accumulates in FP32; the
two per-tensor decode scales are applied to the FP32 accumulator afterwards, as cuBLASLt's ``alpha`` does.

Contract: products exact, FP32 accumulation. With FP32 operands (``DS_NVFP4_EMULATED_OPERAND=fp32``, or a CPU
without BF16 units) the output is bit-for-bit the FP32-accumulated reference. With BF16 operands a library that
returns only BF16 (oneDNN on CPU) rounds its FP32 accumulator to BF16 once before alpha is applied: the output is
within one BF16 ulp of the reference (tests/kernels/test_operand.py); on CUDA ``torch.mm(..., out_dtype=float32)``
keeps the FP32 accumulator where torch offers it. Only the accumulation order differs from FP4 tensor cores.

Quantization goes straight to the operand (``quantize_values``: one pass, the codes only when kept).
"""

from __future__ import annotations

import functools

import torch

from ..format import NVFP4Storage, _kernels, quantize, quantize_values
from ..format.constants import GLOBAL_SCALE_NUMERATOR
from ..format.grouped import quantize_grouped
from .base import GemmBackend, GroupedOperand, Operand, check_operands, global_alpha
from .operand import operand_choice
from .registry import register


@functools.cache
def _cuda_mm_out_dtype() -> bool:
    """Whether this torch offers ``torch.mm(bf16, bf16, out_dtype=torch.float32)`` on CUDA (torch >= 2.8)."""
    try:
        a = torch.zeros(16, 16, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except Exception:
        return False


def matmul_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for exact operands ``a`` [M, K], ``b`` [K, N] (float32 or bfloat16) with FP32 accumulation: the
    float32 accumulator, or (BF16 operands on CPU, where oneDNN returns only BF16) that accumulator rounded once."""
    if a.dtype == torch.bfloat16 and a.is_cuda and _cuda_mm_out_dtype():
        return torch.mm(a, b, out_dtype=torch.float32)
    return a @ b


def grouped_linear_acc(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, alpha: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [M, N], nonfinite)``: rows of group ``g`` of ``a`` ``[M, K]`` times ``b[g].T`` (``b`` ``[G, N, K]``;
    exact operand values, FP32 accumulation), then the epilogue of group ``g`` (``alpha[g]`` and ``bias[g]``, as
    :func:`_kernels.epilogue`). Rows past ``offsets[-1]`` are 0.

    One host read of the offsets, then per group one GEMM (:func:`matmul_acc`, the per-expert path's very GEMM, so
    FP32 operands are bit-exact) written into one accumulator, and one epilogue pass over all rows with each row's
    group's alpha (C++ on CPU; per group when there is a bias or the GEMM returns another dtype, as CUDA's float32
    accumulator does): on CPU oneDNN's GEMM is faster than torch's grouped_mm, which is itself a loop of GEMMs there
    (bench/experts.py), and one epilogue over a fixed [M, N] costs one pass where per-group ones cost a copy each."""
    ends = offsets.tolist()
    if bias is None and not (a.dtype == torch.bfloat16 and a.is_cuda and _cuda_mm_out_dtype()):
        acc = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                torch.mm(a[start:end], b[g].t(), out=acc[start:end])
            start = end
        counts = torch.diff(offsets.to(torch.int64), prepend=offsets.new_zeros(1, dtype=torch.int64))
        rows_alpha = torch.repeat_interleave(alpha.to(torch.float32), counts, output_size=start)
        if start < a.shape[0]:  # rows routed nowhere: 0, whatever the library left there
            acc[start:] = 0
            rows_alpha = torch.cat([rows_alpha, rows_alpha.new_ones(a.shape[0] - start)])
        return _kernels.epilogue(acc, rows_alpha, None, out_dtype)
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    bad = torch.zeros((), dtype=torch.bool, device=a.device)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            part, flag = _kernels.epilogue(matmul_acc(a[start:end], b[g].t()), alpha[g],
                                           None if bias is None else bias[g], out_dtype)
            out[start:end] = part
            bad = bad | flag
        start = end
    if start < a.shape[0]:
        out[start:] = 0
    return out, bad


@register(preference=100, available=lambda info: (True, "exact emulation, runs on any device"))
class EmulatedBackend(GemmBackend):
    """``operand``: the operand dtype, or None for the device's choice (kernels/operand.py)."""

    name = "emulated"

    def __init__(self, operand: torch.dtype | None = None) -> None:
        self.fixed = operand

    def operand_dtype(self, device: torch.device) -> torch.dtype:
        return self.fixed or operand_choice(device).dtype

    def quantize(self, x: torch.Tensor, *, block: str = "1x16", rounding: str = "nearest",
                 amax: torch.Tensor | None = None, keep_codes: bool = False, scaling: str = "6",
                 e4m3_bound: int | None = None, error: str = "MAE") -> Operand:
        dtype = self.operand_dtype(x.device)
        if rounding == "nearest" and x.dim() == 2 and scaling == "6":  # the one-pass kernel is standard NVFP4's
            values, used, q = quantize_values(x, block=block, amax=amax, dtype=dtype, keep_codes=keep_codes)
            return Operand(used, q, values)
        q = quantize(x, block=block, rounding=rounding, amax=amax, scaling=scaling, e4m3_bound=e4m3_bound,
                     error=error)
        return Operand(q.amax, q, q.block_values(dtype))

    def operand(self, q: NVFP4Storage | Operand) -> Operand:
        if isinstance(q, Operand):
            if q.values is not None:
                return q
            q = q.tensor
        return Operand(q.amax, q, q.block_values(self.operand_dtype(q.device)))

    def mm(self, a: NVFP4Storage | Operand, b: NVFP4Storage | Operand, out_dtype: torch.dtype) -> torch.Tensor:
        return self.linear(a, b, None, out_dtype)[0]

    grouped = True

    def quantize_grouped(self, x: torch.Tensor, row_group: torch.Tensor, groups: int, *, block: str = "1x16",
                         amax: torch.Tensor | None = None, keep_codes: bool = False) -> GroupedOperand:
        values, used, data, scale = quantize_grouped(x, row_group, groups, block=block, amax=amax,
                                                     dtype=self.operand_dtype(x.device), keep_codes=keep_codes)
        return GroupedOperand(used, scale, data, values, block)

    def grouped_linear(self, a: GroupedOperand, b: GroupedOperand, offsets: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        groups = offsets.numel()
        # each group's alpha: the product of its two decode scales, in global_alpha's float32 order
        inv = torch.tensor(1.0 / (GLOBAL_SCALE_NUMERATOR * GLOBAL_SCALE_NUMERATOR), dtype=torch.float32,
                           device=a.amax.device)
        return grouped_linear_acc(a.values, b.values.view(groups, -1, b.values.shape[1]), offsets,
                                  (a.amax * b.amax) * inv, bias, out_dtype)


    def linear(self, a: NVFP4Storage | Operand, b: NVFP4Storage | Operand, bias: torch.Tensor | None,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        check_operands(a, b)
        a, b = self.operand(a), self.operand(b)
        acc = matmul_acc(a.values, b.values.t())
        # alpha, bias and the output cast in one pass (C++ on CPU; same float32 order as the eager definition)
        return _kernels.epilogue(acc, global_alpha(a, b), bias, out_dtype)


#: the bit-exact FP32-operand emulation: the reference native backends and the other modes are checked against
reference = EmulatedBackend(torch.float32)
