"""The quantize / dequantize kernels of NVFP4, written as plain tensor programs.

Operation order follows TE >= 2.14 exactly (docs/format.md):

    S_enc = 2688 / amax          (amax == 0 or S_enc == 0 -> 1.0; capped at FLT_MAX)
    S_dec = 1 / S_enc
    s_b   = e4m3(block_amax * (S_enc * (1/6)))     RNE, saturating at 448, subnormal and zero allowed
    enc_b = min(1 / (s_b * S_dec), FLT_MAX)
    q     = e2m1(x * enc_b)
    x'    = e2m1(q) * (s_b * amax * (1/2688))

All arithmetic is float32. Shapes use M rows and K columns (K the reduction dimension); ``nb = K/16``.
"""

from __future__ import annotations

import torch

from . import _cpu_ext, e2m1
from ._compile import compiled
from .constants import BLOCK_SIZE, E4M3_MAX, FLT_MAX, GLOBAL_SCALE_NUMERATOR

_F32 = torch.float32


def _c(value: float, like: torch.Tensor) -> torch.Tensor:
    """A float32 constant (never a Python double: the order of float32 roundings is the contract)."""
    return torch.tensor(value, dtype=_F32, device=like.device)


def _tiles(x: torch.Tensor, block: str) -> torch.Tensor:
    """View a 2-D [M, K] tensor with one trailing axis per block element.

    1x16 -> [M, nb, 16]; 16x16 -> [M/16, 16, nb, 16].
    """
    m, k = x.shape
    if block == "1x16":
        return x.view(m, k // BLOCK_SIZE, BLOCK_SIZE)
    return x.view(m // BLOCK_SIZE, BLOCK_SIZE, k // BLOCK_SIZE, BLOCK_SIZE)


def block_amax(x: torch.Tensor, block: str) -> torch.Tensor:
    """max |x| per block, float32: [M, nb] for 1x16, [M/16, nb] for 16x16. NaN propagates."""
    # abs() before the blocked view: the other order is one Inductor has miscompiled (see _compile.py).
    t = _tiles(x.to(_F32).abs(), block)
    if block == "1x16":
        return t.amax(dim=-1)
    return t.amax(dim=(1, 3))


def scales(bamax: torch.Tensor, amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor and per-block scales from the block amaxes.

    Args:
        bamax: float32 block amaxes from :func:`block_amax`.
        amax: float32 0-dim per-tensor amax to use instead of ``bamax.max()`` (e.g. one agreed across
            ZeRO ranks), or None.
    Returns:
        ``(amax, scale, enc)``: the float32 0-dim amax stored with the tensor (NaN when the input or the
        given amax is not finite: the poison flag), the float8_e4m3fn block scales (bamax's shape) and
        the float32 encode multipliers ``enc_b`` (bamax's shape).
    """
    local = bamax.amax()
    used = local if amax is None else amax.to(_F32).reshape(())
    finite = torch.isfinite(local) & torch.isfinite(used)
    used = torch.where(finite, used, _c(float("nan"), bamax))
    s_enc = _c(GLOBAL_SCALE_NUMERATOR, bamax) / used
    s_enc = torch.where((used == 0) | (s_enc == 0), _c(1.0, bamax), s_enc)
    s_enc = torch.clamp(s_enc, max=FLT_MAX)
    s_dec = _c(1.0, bamax) / s_enc
    scale = torch.clamp(bamax * (s_enc * _c(1.0 / 6.0, bamax)), max=E4M3_MAX).to(torch.float8_e4m3fn)
    enc = torch.clamp(_c(1.0, bamax) / (scale.to(_F32) * s_dec), max=FLT_MAX)
    return used, scale, enc


def _block_scales_cpp(x: torch.Tensor, block: str,
                      amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The C++ twin of :func:`block_scales` (``csrc/nvfp4_cpu.cpp``), or None where it does not apply."""
    ext = _cpu_ext_for(x, x.dtype)
    if ext is None:
        return None
    given = None if amax is None else amax.to(_F32).reshape(()).contiguous()
    return tuple(ext.block_scales(x, given, 1 if block == "1x16" else BLOCK_SIZE))


@compiled(native=_block_scales_cpp)
def block_scales(x: torch.Tensor, block: str,
                 amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`scales` of :func:`block_amax`: ``(amax, scale, enc)`` of a 2-D ``x`` [M, K], the first step of a
    storage quantize. One C++ call on CPU; elsewhere the compiled (or eager) composition. The twin spares every
    process the torch.compile of these two small kernels (seconds per process and argument signature, even with
    Inductor's on-disk cache warm)."""
    return scales(block_amax(x, block), amax)


def _scaled(x: torch.Tensor, enc: torch.Tensor, block: str) -> torch.Tensor:
    t = _tiles(x, block).to(_F32)
    if block == "1x16":
        return t * enc.unsqueeze(-1)
    return t * enc[:, None, :, None]


def _cpu_ext_for(t: torch.Tensor, dtype: torch.dtype):
    """The C++ extension when it applies to a contiguous CPU tensor ``t`` and a float32/bfloat16 ``dtype``."""
    if t.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not t.is_contiguous():
        return None
    return _cpu_ext.extension()


def _encode_nearest_cpp(x: torch.Tensor, enc: torch.Tensor, block: str) -> torch.Tensor | None:
    """The C++ twin of :func:`encode_nearest` (``csrc/nvfp4_cpu.cpp``), or None where it does not apply."""
    ext = _cpu_ext_for(x, x.dtype)
    if ext is None:
        return None
    return ext.encode_nearest(x, enc.contiguous(), 1 if block == "1x16" else BLOCK_SIZE)


@compiled(native=_encode_nearest_cpp)
def encode_nearest(x: torch.Tensor, enc: torch.Tensor, block: str) -> torch.Tensor:
    """Packed uint8 codes [M, K/2] of ``x * enc_b`` rounded to nearest-even."""
    m, k = x.shape
    return e2m1.pack(e2m1.encode_rne(_scaled(x, enc, block)).reshape(m, k))


def _encode_stochastic_cpp(x: torch.Tensor, enc: torch.Tensor, block: str,
                           random_bytes: torch.Tensor) -> torch.Tensor | None:
    """The C++ twin of :func:`encode_stochastic` (``csrc/nvfp4_cpu.cpp``), or None where it does not apply."""
    ext = _cpu_ext_for(x, x.dtype)
    if ext is None or not random_bytes.is_contiguous():
        return None
    return ext.encode_stochastic(x, enc.contiguous(), 1 if block == "1x16" else BLOCK_SIZE, random_bytes)


@compiled(native=_encode_stochastic_cpp)
def encode_stochastic(x: torch.Tensor, enc: torch.Tensor, block: str, random_bytes: torch.Tensor) -> torch.Tensor:
    """Packed uint8 codes [M, K/2] of ``x * enc_b`` rounded stochastically with ``random_bytes`` [M, K]."""
    m, k = x.shape
    y = _scaled(x, enc, block).reshape(m, k)
    return e2m1.pack(e2m1.encode_stochastic(y, random_bytes))


def _decode_factor(scale: torch.Tensor, amax: torch.Tensor,
                   numerator: float = GLOBAL_SCALE_NUMERATOR) -> torch.Tensor:
    """float32 per-block decode factors ``s_b * amax / 2688`` (scale's shape), in the contract's rounding order;
    ``numerator`` is ``6 * bound`` for a tensor quantized with another global E4M3 bound (4/6: 1536)."""
    return (scale.to(_F32) * amax) * _c(1.0 / numerator, scale)


def decode_bounded(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, block: str, dtype: torch.dtype,
                   bound: float) -> torch.Tensor:
    """:func:`decode` of a tensor whose global scale used the E4M3 bound ``bound`` instead of 448 (4/6): the same
    products, ``e2m1(q) * (s_b * amax * (1 / (6 bound)))``, rounded once to ``dtype``."""
    return block_values(data, _decode_factor(scale, amax, 6.0 * bound), block, dtype)


def _decode_cpp(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, block: str,
                dtype: torch.dtype) -> torch.Tensor | None:
    """The C++ twin of :func:`decode` (``csrc/nvfp4_cpu.cpp``), or None where it does not apply."""
    ext = _cpu_ext_for(data, dtype)
    if ext is None:
        return None
    factor = _decode_factor(scale, amax).contiguous()
    return ext.decode(data, factor, 1 if block == "1x16" else BLOCK_SIZE, dtype == torch.bfloat16)


@compiled(native=_decode_cpp)
def decode(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, block: str, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize packed codes [M, K/2] with block scales and the tensor amax to ``dtype`` [M, K]."""
    m = data.shape[0]
    k = data.shape[1] * 2
    factor = _decode_factor(scale, amax)
    values = _tiles(e2m1.decode(e2m1.unpack(data)), block)
    if block == "1x16":
        out = values * factor.unsqueeze(-1)
    else:
        out = values * factor[:, None, :, None]
    return out.reshape(m, k).to(dtype)


def _block_values_cpp(data: torch.Tensor, scale: torch.Tensor, block: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The C++ twin of :func:`block_values`: ``decode`` with the block scales as the factors (no amax)."""
    ext = _cpu_ext_for(data, dtype)
    if ext is None:
        return None
    return ext.decode(data, scale.to(_F32).contiguous(), 1 if block == "1x16" else BLOCK_SIZE, dtype == torch.bfloat16)


@compiled(native=_block_values_cpp)
def block_values(data: torch.Tensor, scale: torch.Tensor, block: str, dtype: torch.dtype) -> torch.Tensor:
    """``dtype`` [M, K]: E2M1 value times its E4M3 block scale, without the per-tensor factor.

    ``scale`` is the stored layout (``[M, K/16]`` for 1x16, ``[M/16, K/16]`` for 16x16). The products have at most
    6 significant bits, so they are exact in float32 and in bfloat16: these are the operand values an FP4 tensor
    core multiplies, and what the ``emulated`` backend hands its GEMM.
    """
    m = data.shape[0]
    k = data.shape[1] * 2
    values = _tiles(e2m1.decode(e2m1.unpack(data)), block)
    s = scale.to(_F32)
    out = values * (s.unsqueeze(-1) if block == "1x16" else s[:, None, :, None])
    return out.reshape(m, k).to(dtype)


def encode_values(x: torch.Tensor, enc: torch.Tensor, scale: torch.Tensor, block: str, dtype: torch.dtype,
                  want_codes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize (nearest-even) and produce the GEMM operand: ``(values [M, K] dtype, codes [M, K/2] uint8)``.

    ``values`` are :func:`block_values` of the codes :func:`encode_nearest` gives for ``x`` (``codes`` is an empty
    tensor unless ``want_codes``). Eager only: the definition inside :func:`quantize_operand`, whose C++ twin does it
    all in one call.
    """
    codes = encode_nearest.fn(x, enc, block)
    values = block_values.fn(codes, scale, block, dtype)
    return values, (codes if want_codes else x.new_empty(0, dtype=torch.uint8))


def _quantize_operand_cpp(x: torch.Tensor, amax: torch.Tensor | None, block: str, dtype: torch.dtype,
                          want_codes: bool) -> tuple[torch.Tensor, ...] | None:
    """The C++ twin of :func:`quantize_operand` (one call: block amaxes, scales, codes and values)."""
    ext = _cpu_ext_for(x, dtype)
    if ext is None or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    values, codes, scale, used = ext.quantize_operand(x, amax, 1 if block == "1x16" else BLOCK_SIZE,
                                                      dtype == torch.bfloat16, want_codes)
    return values, codes, scale, used


@compiled(native=_quantize_operand_cpp)
def quantize_operand(x: torch.Tensor, amax: torch.Tensor | None, block: str, dtype: torch.dtype,
                     want_codes: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values [M, K] dtype, codes [M, K/2] uint8 or empty, scale e4m3 (bamax's shape), amax 0-dim)``: the
    composition block_amax -> scales -> encode_values, i.e. ``ds_nvfp4.quantize`` straight to GEMM operands."""
    used, scale, enc = scales(block_amax(x, block), amax)
    values, codes = encode_values(x, enc, scale, block, dtype, want_codes)
    return values, codes, scale, used


def _epilogue_cpp(acc: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    ext = _cpu_ext_for(acc, dtype)
    if ext is None or acc.dim() != 2 or acc.dtype not in (torch.float32, torch.bfloat16):
        return None
    out, bad = ext.epilogue(acc, alpha, bias, dtype == torch.bfloat16)
    return out, bad


@compiled(native=_epilogue_cpp)
def epilogue(acc: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The emulated GEMM's epilogue: ``(dtype(float32(acc) * alpha [+ float32(bias)]), any output non-finite)``.

    ``acc`` [M, N] is the library's accumulator (float32, or bfloat16 where the library rounds it once), ``alpha``
    the float32 0-dim product of the per-tensor decode scales, or float32 ``[M]``, each row's own (a grouped GEMM,
    whose groups have their own scales). One pass instead of four on CPU.
    """
    out = acc.to(_F32) * (alpha.unsqueeze(1) if alpha.dim() == 1 else alpha)
    if bias is not None:
        out = out + bias.to(_F32)
    out = out.to(dtype)
    return out, ~torch.isfinite(out).all()
