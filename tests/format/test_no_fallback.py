"""On this kind of machine the fast kernels must be the ones running: a kernel that silently fell back to a
slower implementation keeps results right but loses the speed, so CI fails on it (the reason is printed)."""

from __future__ import annotations

import os

import pytest
import torch

import ds_nvfp4
from ds_nvfp4.format import _compile, _cpu_ext, _kernels


def test_no_format_kernel_fell_back() -> None:
    if not _compile.compile_enabled(torch.device("cpu")):
        if os.environ.get("CI"):
            pytest.fail("compiled CPU format kernels are off in CI "
                        f"(DS_NVFP4_COMPILE={os.environ.get('DS_NVFP4_COMPILE')})")
        pytest.skip("compiled CPU format kernels are off here (DS_NVFP4_COMPILE / no C++ compiler)")
    assert _cpu_ext.extension() is not None, _cpu_ext.unavailable_reason
    # every kernel and the signatures training uses: 1x16 and 16x16, nearest and stochastic, bf16 and fp32
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 128).to(dtype)
        for block in ("1x16", "16x16"):
            for rounding in ("nearest", "stochastic"):
                q = ds_nvfp4.quantize(x, block=block, rounding=rounding)
                q.dequantize(torch.bfloat16)
                q.dequantize(torch.float32)
                q.block_values()
                q.block_values(torch.bfloat16)
            for out in (torch.bfloat16, torch.float32):  # the fused quantize -> GEMM operand pass
                ds_nvfp4.quantize_values(x, block=block, dtype=out)
                ds_nvfp4.quantize_values(x, block=block, dtype=out, keep_codes=True)
    # the GEMM epilogue: one alpha (a GEMM) and one per row (a grouped GEMM), BF16 and FP32 accumulators
    for acc_dtype in (torch.bfloat16, torch.float32):
        acc = torch.randn(64, 48).to(acc_dtype)
        for alpha in (torch.tensor(0.37), torch.rand(64)):
            for out in (torch.bfloat16, torch.float32):
                _kernels.epilogue(acc, alpha, None, out)
                _kernels.epilogue(acc, alpha, torch.randn(48), out)
    assert _compile.status() == {}, _compile.status()
    # the storage quantize's scales ran in C++ (verified there), not through a torch.compile in every process
    assert any(key[0] for key in _kernels.block_scales.verified), _kernels.block_scales.verified
