"""The public quantizer: `quantize` and `dequantize`."""

from __future__ import annotations

import torch

from . import _kernels, four_over_six
from .constants import BLOCK_SIZE, BLOCKS, ROUNDINGS
from .scaling import WeightScaling
from .storage import NVFP4Storage


def _check(x: torch.Tensor, block: str, rounding: str, amax: torch.Tensor | None) -> None:
    if block not in BLOCKS:
        raise ValueError(f"block={block!r}: allowed values are {', '.join(map(repr, BLOCKS))}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: allowed values are {', '.join(map(repr, ROUNDINGS))}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize takes float32 or bfloat16 tensors, got {x.dtype}")
    shape = tuple(x.shape)
    if x.dim() == 0 or shape[-1] % BLOCK_SIZE:
        raise ValueError(f"tensor of shape {shape}: the last dimension K must be a multiple of {BLOCK_SIZE}")
    if block == "16x16" and (x.dim() != 2 or shape[0] % BLOCK_SIZE):
        raise ValueError(f"tensor of shape {shape}: block='16x16' needs a 2-D [M, K] tensor with "
                         f"M and K multiples of {BLOCK_SIZE}")
    if amax is not None and (not isinstance(amax, torch.Tensor) or amax.numel() != 1
                             or amax.dtype != torch.float32):
        raise ValueError("amax must be a float32 tensor with one element (the per-tensor max |x|)")


def _random_bytes(shape: torch.Size, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """uint8 ``shape`` of uniform random bytes: 64-bit draws cut into 8 bytes (6x faster on CPU than one
    ``randint`` draw per byte, the same distribution up to a 2^-64 bias)."""
    n = 1
    for d in shape:
        n *= d
    words = torch.empty((n + 7) // 8, dtype=torch.int64, device=device)
    words.random_(-(2**63), 2**63 - 1, generator=generator)
    return words.view(torch.uint8)[:n].view(shape)


def quantize(
    x: torch.Tensor,
    *,
    block: str = "1x16",
    rounding: str = "nearest",
    amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    scaling: str | WeightScaling = "6",
    e4m3_bound: int | None = None,
    error: str = "MAE",
) -> NVFP4Storage:
    """Quantize ``x`` to NVFP4 with TE's two-level scaling, bit-compatible with TE >= 2.14.

    Args:
        x: float32 or bfloat16 ``[..., K]`` with ``K % 16 == 0`` (``[M, K]`` with ``M % 16 == 0`` too for
            ``block="16x16"``). Any strides; a contiguous copy is made if needed.
        block: ``"1x16"`` (16 consecutive elements along K share a scale) or ``"16x16"`` (a 2-D tile does).
        rounding: ``"nearest"`` (round half to even, saturating at +-6) or ``"stochastic"`` (unbiased, 8
            random bits per element drawn from ``generator``).
        amax: float32 one-element tensor used as the per-tensor amax instead of ``max|x|`` (ZeRO shards
            pass the amax agreed across ranks). It must be >= max|x| for the codes not to saturate.
        generator: random source for stochastic rounding (default: torch's global generator).
        scaling: a :class:`WeightScaling` (what converted layers pass: their recipe's), or its kind: ``"6"``
            (standard NVFP4: each block's max maps to 6) or ``"4over6"`` (each block maps to 4 or to 6, whichever
            errs less: format/four_over_six.py, TE's ``nvfp4_4over6``; nearest rounding only).
        e4m3_bound: the global E4M3 bound, 448 or 256 (4/6 only; default 256 there, as TE's); with a string
            ``scaling`` only.
        error: 4/6's error metric, ``"MAE"`` (TE's default) or ``"MSE"``; with a string ``scaling`` only.
    Returns:
        An :class:`NVFP4Storage`. Non-finite input (or amax) poisons the result: its amax is NaN and it
        dequantizes to NaN everywhere; ``result.nonfinite`` reports it without a device sync.
    """
    _check(x, block, rounding, amax)
    spec = _scaling_of(scaling, e4m3_bound, error, rounding)
    bound = spec.e4m3_bound
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if not spec.standard:
        used_amax, scale, data = four_over_six.quantize_2d(x2, _kernels.block_amax(x2, block), amax, block,
                                                           bound, spec.error)
    else:
        used_amax, scale, enc = _kernels.block_scales(x2, block, amax)
        if rounding == "nearest":
            data = _kernels.encode_nearest(x2, enc, block)
        else:
            random_bytes = _random_bytes(x2.shape, x2.device, generator)
            data = _kernels.encode_stochastic(x2, enc, block, random_bytes)
    if block == "1x16":
        data = data.reshape(*shape[:-1], shape[-1] // 2)
        scale = scale.reshape(*shape[:-1], shape[-1] // BLOCK_SIZE)
    return NVFP4Storage(data=data, scale=scale, amax=used_amax, shape=torch.Size(shape), block=block,
                        e4m3_bound=float(bound))


def _scaling_of(scaling: str | WeightScaling, e4m3_bound: int | None, error: str, rounding: str) -> WeightScaling:
    """The typed scaling for ``quantize``'s arguments, or a ValueError naming the argument."""
    if isinstance(scaling, WeightScaling):
        if e4m3_bound is not None or error != "MAE":
            raise TypeError("quantize: give the bound and the error inside the WeightScaling, not beside it")
        spec = scaling
    else:
        spec = WeightScaling.of(scaling, e4m3_bound, error)
    if not spec.standard and rounding != "nearest":
        raise ValueError("scaling='4over6' is defined for rounding='nearest' only (as in Transformer Engine)")
    return spec


def quantize_values(
    x: torch.Tensor,
    *,
    block: str = "1x16",
    amax: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    keep_codes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, NVFP4Storage | None]:
    """Quantize ``x`` (round to nearest even) straight to GEMM operand values, in one pass over ``x``.

    Args:
        x, block, amax: as for :func:`quantize` (``x`` 2-D ``[M, K]``).
        dtype: float32 or bfloat16; the values are exact in both.
        keep_codes: also return the :class:`NVFP4Storage` (codes and scales), e.g. to save for a backward pass.
    Returns:
        ``(values, amax, tensor)``: ``dtype`` ``[M, K]`` equal to ``quantize(x, ...).block_values(dtype)``
        bit for bit, the float32 0-dim amax used (NaN if ``x`` held NaN/Inf), and the tensor or None.
    """
    _check(x, block, "nearest", amax)
    if x.dim() != 2:
        raise ValueError(f"quantize_values takes a 2-D [M, K] tensor, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    values, data, scale, used_amax = _kernels.quantize_operand(x, amax, block, dtype, keep_codes)
    tensor = NVFP4Storage(data=data, scale=scale, amax=used_amax, shape=x.shape, block=block) if keep_codes else None
    return values, used_amax, tensor


def dequantize(t: NVFP4Storage, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Same as ``t.dequantize(dtype)``."""
    return t.dequantize(dtype)
