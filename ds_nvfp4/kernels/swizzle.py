"""The 128x4 "blocked" layout cuBLASLt wants for VEC16_UE4M3 block scales.

For a row-major scale matrix ``[R, C]`` (R rows of the operand, ``C = K/16``) padded to
``[roundup(R, 128), roundup(C, 4)]``, scale ``(r, c)`` lands at flat offset
``((r // 128) * ceil(C / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``.
"""

from __future__ import annotations

import torch


def ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_scales(scale: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` -> ``[roundup(R,128), roundup(C,4)]`` with zero padding (a zero scale contributes nothing)."""
    r, c = scale.shape
    out = torch.zeros(ceil_to(r, 128), ceil_to(c, 4), dtype=scale.dtype, device=scale.device)
    out.view(torch.uint8)[:r, :c] = scale.view(torch.uint8)
    return out


def swizzle_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Row-major ``[R, C]`` scales -> flat blocked layout, ``roundup(R,128) * roundup(C,4)`` elements."""
    p = pad_scales(scale).view(torch.uint8)
    rp, cp = p.shape
    blocked = (p.view(rp // 128, 4, 32, cp // 4, 4)  # (row tile, r%128//32, r%32, col tile, c%4)
               .permute(0, 3, 2, 1, 4)               # (row tile, col tile, r%32, r%128//32, c%4)
               .reshape(-1))
    return blocked.view(scale.dtype)


def swizzle_offset(r: int, c: int, cols: int) -> int:
    """The documented offset formula (used by the tests as the definition)."""
    return ((r // 128) * (-(-cols // 4)) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
