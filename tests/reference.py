"""A pure-PyTorch reference of NVFP4 quantization, written from docs/format.md's formulas.

Deliberately independent of ds_nvfp4's code: codes by interval masks (as TE's Python reference writes
them), scale expansion by repeat_interleave, packing by strided slices. Slow, obvious, the contract.
"""

from __future__ import annotations

import torch

F32 = torch.float32
FLT_MAX = torch.finfo(F32).max
VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=F32)


def ref_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 RNE codes of float32 y; sign bit = IEEE sign bit (the project's documented -0 policy)."""
    a = y.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    mag[(a > 0.25) & (a < 0.75)] = 1
    mag[(a >= 0.75) & (a <= 1.25)] = 2
    mag[(a > 1.25) & (a < 1.75)] = 3
    mag[(a >= 1.75) & (a <= 2.5)] = 4
    mag[(a > 2.5) & (a < 3.5)] = 5
    mag[(a >= 3.5) & (a <= 5.0)] = 6
    mag[a > 5.0] = 7
    return mag + torch.signbit(y).to(torch.uint8) * 8


def ref_pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[:, ::2] + codes[:, 1::2] * 16


def ref_block_amax(x: torch.Tensor, block: str) -> torch.Tensor:
    m, k = x.shape
    if block == "1x16":
        return x.abs().reshape(m, k // 16, 16).max(dim=2).values
    tiles = x.abs().reshape(m // 16, 16, k // 16, 16).permute(0, 2, 1, 3)
    return tiles.reshape(m // 16, k // 16, 256).max(dim=2).values


def expand(s: torch.Tensor, block: str) -> torch.Tensor:
    """Per-block values -> per-element [M, K]."""
    s = s.repeat_interleave(16, dim=1)
    return s if block == "1x16" else s.repeat_interleave(16, dim=0)


def ref_quantize(x: torch.Tensor, block: str = "1x16", amax: torch.Tensor | None = None):
    """Returns (packed uint8 [M, K/2], e4m3 scales per block, float32 amax) for a finite 2-D x."""
    x = x.to(F32)
    amax = x.abs().max() if amax is None else amax.to(F32).reshape(())
    s_enc = f32(2688.0) / amax
    if amax == 0 or s_enc == 0:
        s_enc = f32(1.0)
    s_enc = torch.minimum(s_enc, f32(FLT_MAX))
    s_dec = f32(1.0) / s_enc
    sb = torch.minimum(ref_block_amax(x, block) * (s_enc * f32(1.0 / 6.0)), f32(448.0)).to(torch.float8_e4m3fn)
    enc = torch.minimum(f32(1.0) / (sb.to(F32) * s_dec), f32(FLT_MAX))
    codes = ref_codes(x * expand(enc, block))
    return ref_pack(codes), sb, amax


def ref_dequantize(packed: torch.Tensor, sb: torch.Tensor, amax: torch.Tensor, block: str) -> torch.Tensor:
    """float32 [M, K]."""
    m, half = packed.shape
    codes = torch.empty(m, half * 2, dtype=torch.uint8)
    codes[:, ::2] = packed % 16
    codes[:, 1::2] = packed // 16
    factor = (sb.to(F32) * amax) * f32(1.0 / 2688.0)
    return VALUES[codes.long()] * expand(factor, block)


def all_e4m3_values() -> torch.Tensor:
    """The 254 finite float8_e4m3fn values (both signs), float32, sorted (NaN codes 0x7F/0xFF left out)."""
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = raw.view(torch.float8_e4m3fn).to(F32)
    return torch.sort(vals[torch.isfinite(vals)]).values


def ref_block_values(packed: torch.Tensor, sb: torch.Tensor, block: str) -> torch.Tensor:
    """e2m1 value times its E4M3 block scale, float32 [M, K] (no per-tensor factor): exact."""
    m, half = packed.shape
    codes = torch.empty(m, half * 2, dtype=torch.uint8)
    codes[:, ::2] = packed % 16
    codes[:, 1::2] = packed // 16
    return VALUES[codes.long()] * expand(sb.to(F32), block)


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """float32: the spacing of bfloat16 numbers at ``|t|`` (8 significant bits: 2^(e-8) for |t| in [2^(e-1), 2^e))."""
    e = torch.frexp(t.float().abs().clamp_min(2.0 ** -126))[1]
    return torch.ldexp(torch.ones_like(t, dtype=F32), e - 8)


def emulated_contract_bound(a: torch.Tensor, b: torch.Tensor, a_block: str = "1x16",
                            b_block: str = "16x16") -> tuple[torch.Tensor, torch.Tensor]:
    """``(ref, bound)`` for the BF16-operand emulation of ``a [M,K] @ b[N,K].T`` (docs/format.md): products exact,
    FP32 accumulation in the library's order, its accumulator rounded to BF16 at most once before alpha:
    ``|got - ref| <= ulp_bf16(ref) + K * 2^-24 * (|A| @ |B|.T) * alpha`` (one BF16 ulp, plus the classic bound for
    a different FP32 summation order; A, B the exact operand values)."""
    pa, sa, aa = ref_quantize(a, a_block)
    pb, sb, ab = ref_quantize(b, b_block)
    va, vb = ref_block_values(pa, sa, a_block), ref_block_values(pb, sb, b_block)
    alpha = (aa * ab) * f32(1.0 / (2688.0 * 2688.0))
    ref = (va @ vb.t()) * alpha
    order = a.shape[1] * 2.0 ** -24 * (va.abs() @ vb.abs().t()) * alpha
    return ref, bf16_ulp(ref) + order


def ref_fp4_gemm(a: torch.Tensor, b: torch.Tensor, a_block: str = "1x16", b_block: str = "16x16") -> torch.Tensor:
    """What the FP4 tensor cores compute for ``a [M,K] @ b[N,K].T``: exact operand values, FP32 accumulation,
    ``alpha = amax_a * amax_b / 2688^2`` applied to the accumulator."""
    pa, sa, aa = ref_quantize(a, a_block)
    pb, sb, ab = ref_quantize(b, b_block)
    acc = ref_block_values(pa, sa, a_block) @ ref_block_values(pb, sb, b_block).t()
    return acc * ((aa * ab) * f32(1.0 / (2688.0 * 2688.0)))
