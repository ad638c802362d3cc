"""The scales handed to ``torch._scaled_mm`` sit where cuBLASLt reads them (the documented 128x4 offsets)."""

from __future__ import annotations

import torch

import ds_nvfp4
from ds_nvfp4.kernels.swizzle import swizzle_offset
from ds_nvfp4.kernels.torch_native import build_scaled_mm_args


def test_scaled_mm_scales_are_swizzled_at_the_documented_offsets() -> None:
    torch.manual_seed(0)
    a = ds_nvfp4.quantize(torch.randn(200, 48) * torch.logspace(-3, 3, 48))  # distinct scales per block
    b = ds_nvfp4.quantize(torch.randn(48, 48), block="16x16")
    args = build_scaled_mm_args(a, b)
    for t, flat, rows in ((a, args.scale_a, 200), (b, args.scale_b, 48)):
        src = t.rowwise_scale().view(torch.uint8)           # [rows, K/16] row-major, K/16 = 3 (padded to 4)
        got = flat.view(torch.uint8)
        cols = 64 // 16                                     # K padded to 64 for cuBLASLt
        for r in range(rows):
            for c in range(3):
                assert got[swizzle_offset(r, c, cols)] == src[r, c], (r, c)
        assert len(torch.unique(src)) > 4  # the check would be vacuous with one repeated scale
