"""`torch`: native Blackwell FP4 GEMM through ``torch._scaled_mm`` (cuBLASLt, CUDA >= 12.8, torch >= 2.8).

Operands: ``float4_e2m1fn_x2`` ``a`` ``[M, K/2]`` row-major and ``b`` ``[K/2, N]`` column-major (the transpose
view of our ``[N, K/2]`` bytes), E4M3 scales in the 128x4 blocked layout. ``_scaled_mm`` takes no per-tensor
scale for this format, so we ask for a float32 output and multiply by the global alpha ourselves: the result is
rounded to ``out_dtype`` once, exactly as in the emulation. Shape rules: K % 32 == 0 and
N % 16 == 0; smaller K/N are zero-padded here (zero codes add nothing). Only built and called on sm_100+.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format import NVFP4Storage
from .base import GemmBackend, Operand, check_operands, codes, global_alpha
from .device import DeviceInfo, fp4_tensor_cores
from .registry import register
from .swizzle import ceil_to, swizzle_128x4


@dataclass
class ScaledMMArgs:
    """Everything ``torch._scaled_mm`` receives, built on any device (unit-tested on CPU)."""

    a: torch.Tensor        # float4_e2m1fn_x2 [M, Kp/2], row-major
    b: torch.Tensor        # float4_e2m1fn_x2 [Kp/2, Np], column-major (stride (1, Kp/2))
    scale_a: torch.Tensor  # float8_e4m3fn, roundup(M,128) * roundup(Kp/16,4), blocked
    scale_b: torch.Tensor  # float8_e4m3fn, roundup(Np,128) * roundup(Kp/16,4), blocked
    alpha: torch.Tensor    # float32 0-dim, applied to the float32 output
    n: int                 # real N (columns beyond it are padding)


def _padded(t: NVFP4Storage, rows_to: int, k_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = t.shape
    data = t.data.reshape(m, k // 2)
    scale = t.rowwise_scale()
    if rows_to == m and k_to == k:
        return data, scale
    d = torch.zeros(rows_to, k_to // 2, dtype=torch.uint8, device=data.device)
    d[:m, : k // 2] = data
    s = torch.zeros(rows_to, k_to // 16, dtype=torch.uint8, device=data.device)
    s[:m, : k // 16] = scale.view(torch.uint8)
    return d, s.view(torch.float8_e4m3fn)


def build_scaled_mm_args(a: NVFP4Storage, b: NVFP4Storage) -> ScaledMMArgs:
    check_operands(a, b)
    m, k = a.shape
    n = b.shape[0]
    kp, np_ = ceil_to(k, 32), ceil_to(n, 16)
    a_data, a_scale = _padded(a, m, kp)
    b_data, b_scale = _padded(b, np_, kp)
    fp4 = torch.float4_e2m1fn_x2
    return ScaledMMArgs(
        a=a_data.view(fp4),
        b=b_data.view(fp4).t(),
        scale_a=swizzle_128x4(a_scale),
        scale_b=swizzle_128x4(b_scale),
        alpha=global_alpha(a, b),
        n=n,
    )


def available(info: DeviceInfo) -> tuple[bool, str]:
    """FP4 tensor cores, a torch with the FP4 dtype and ``_scaled_mm``, CUDA >= 12.8 (cuBLASLt's FP4 GEMM)."""
    cores, why = fp4_tensor_cores(info)
    if not cores:
        return False, why
    if not info.torch_fp4:
        return False, f"torch {info.torch_version} lacks float4_e2m1fn_x2 / FP4 _scaled_mm (needs >= 2.8)"
    if info.cuda_version is None or tuple(int(v) for v in info.cuda_version.split(".")[:2]) < (12, 8):
        return False, f"CUDA {info.cuda_version} < 12.8: cuBLASLt has no FP4 GEMM"
    return True, f"{why}; torch._scaled_mm with float4_e2m1fn_x2 (cuBLASLt)"


@register(preference=10, available=available)
class TorchNativeBackend(GemmBackend):
    name = "torch"

    def mm(self, a: NVFP4Storage | Operand, b: NVFP4Storage | Operand, out_dtype: torch.dtype) -> torch.Tensor:
        args = build_scaled_mm_args(codes(a), codes(b))
        out = torch._scaled_mm(args.a, args.b, args.scale_a, args.scale_b, out_dtype=torch.float32)
        return (out[:, : args.n] * args.alpha).to(out_dtype)
