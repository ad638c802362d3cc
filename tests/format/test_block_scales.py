"""Properties in units of each block's own scale (a scale 2x off keeps the tensor-level bounds but fails these)."""

from __future__ import annotations

import torch
from hypothesis import given

import ds_nvfp4
from ds_nvfp4.format import e2m1
from tests.format.test_properties import matrices

E4M3_MIN_NORMAL = 2.0**-6


def _per_block(x: torch.Tensor, block: str):
    """(|x| amax, decoded block scale, max |code value|, max |x - dequant|) per block, and the E4M3 scale codes."""
    q = ds_nvfp4.quantize(x, block=block)
    m, k = x.shape
    vals = e2m1.decode(q.codes()).float().abs()
    err = (x - q.dequantize(torch.float32)).abs()
    e4m3 = q.rowwise_scale().float()                                 # [M, K/16]
    decoded = e4m3 * q.amax / 2688.0
    view = (lambda t: t.reshape(m, k // 16, 16)) if block == "1x16" else (
        lambda t: t.reshape(m // 16, 16, k // 16, 16).transpose(1, 2).reshape(m // 16, k // 16, 256))
    first_rows = slice(None) if block == "1x16" else slice(None, None, 16)
    return (view(x.abs()).amax(-1), decoded[first_rows], view(vals).amax(-1), view(err).amax(-1),
            e4m3[first_rows])


@given(matrices(rows_multiple=16))
def test_every_block_uses_its_range_and_errs_within_its_own_scale(x: torch.Tensor) -> None:
    for block in ("1x16", "16x16"):
        amax, scale, top, err, e4m3 = _per_block(x, block)
        normal = (e4m3 >= E4M3_MIN_NORMAL) & (amax > 0)
        # the largest element of a block with a normal E4M3 scale is coded as 6: amax/scale is within 2^-4 of 6
        assert bool((top[normal] == 6).all()), (block, top[normal].unique())
        # no element is further from its value than half the largest E2M1 gap (2) times its block's scale
        assert bool((err[normal] <= scale[normal] * 1.0 * (1 + 2**-20)).all()), block
