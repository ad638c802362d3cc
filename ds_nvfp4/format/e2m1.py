"""E2M1 element codes: round-to-nearest-even and stochastic encoding, decoding, nibble packing.

Layout contract (shared by TE, torchao, ModelOpt and compressed-tensors): element ``2i`` of a row sits in
the LOW nibble of byte ``i``, element ``2i+1`` in the high nibble. Bit 3 of a code is the sign.

Sign policy: the sign bit is the IEEE sign of the scaled input (``signbit``), as the hardware conversion
keeps it. A negative value that rounds to zero therefore gives code 8 (-0), like TE's reference; an input
of exactly ``-0.0`` also gives code 8 (TE's Python reference writes 0 there: the decoded value, zero, is
the same). Keeping the IEEE sign makes ``encode(decode(c)) == c`` hold for all 16 codes.
"""

from __future__ import annotations

import torch

from .constants import E2M1_MAX, e2m1_table


def encode_rne(y: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest E2M1 code (ties to the even code), saturating at +-6.

    Args:
        y: float32 tensor of any shape, already multiplied by its block's encode scale.
    Returns:
        uint8 tensor of the same shape holding codes 0..15 (unpacked).

    Midpoints between grid points go to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0,
    2.5->2.0, 3.5->4.0, 5->4.0; hence the alternating strict/non-strict comparisons below. NaN compares
    false everywhere and gives a zero code; callers poison the tensor's amax instead (see quantize).
    """
    a = y.abs()
    i32 = torch.int32  # int32 arithmetic vectorises better than uint8 in Inductor's CPU code
    mag = (
        (a > 0.25).to(i32)
        + (a >= 0.75).to(i32)
        + (a > 1.25).to(i32)
        + (a >= 1.75).to(i32)
        + (a > 2.5).to(i32)
        + (a >= 3.5).to(i32)
        + (a > 5.0).to(i32)
    )
    return (mag | (torch.signbit(y).to(i32) << 3)).to(torch.uint8)


def encode_stochastic(y: torch.Tensor, random_bytes: torch.Tensor) -> torch.Tensor:
    """Stochastically round float32 values onto the E2M1 grid: ``step * floor(|y|/step + u)``.

    Args:
        y: float32 tensor, already scaled.
        random_bytes: uint8 tensor of y's shape; ``u = random_bytes / 256`` (8 random bits per element,
            as TE's kernels draw them).
    Returns:
        uint8 codes 0..15, same shape as y. The result is always one of the two grid points around |y|
        (saturating at 6), and unbiased up to the 1/256 resolution of u.
    """
    a = y.abs()
    # Grid spacing of E2M1: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]. Dividing by a power of two is exact.
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    u = random_bytes.to(torch.float32) * (1.0 / 256.0)
    q = torch.clamp(torch.floor(a / step + u) * step, max=E2M1_MAX)
    # q lies exactly on the grid, so nearest rounding just reads off its code.
    return encode_rne(q) | (torch.signbit(y).to(torch.uint8) << 3)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 codes (any shape); code 8 decodes to -0.0.

    The sign is applied by a multiplication rather than read from a signed table: Inductor folds a
    -0.0 table constant into +0.0, which would break ``encode(decode(c)) == c`` for code 8.
    """
    magnitude = e2m1_table(codes.device)[(codes & 0x7).long()]
    return magnitude * (1.0 - 2.0 * (codes >> 3).to(torch.float32))


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[..., K]`` (K even) into bytes ``[..., K/2]``, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack needs an even last dimension, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(data: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 bytes ``[..., K/2]`` -> uint8 codes ``[..., K]``."""
    lo = data & 0x0F
    hi = data >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)
