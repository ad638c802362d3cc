"""Grouped quantization (format/grouped.py): each group of rows bit for bit as quantizing that group alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_nvfp4.format import quantize, quantize_values
from ds_nvfp4.format.grouped import group_rows, quantize_grouped


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_each_group_is_quantized_as_alone(sizes: list[int], seed: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    x = (torch.randn(rows, 64, generator=g) * torch.rand(rows, 1, generator=g) * 50).to(dtype)
    offsets = torch.tensor(sizes).cumsum(0)
    values, amax, codes, scale = quantize_grouped(x, group_rows(offsets, rows), len(sizes), dtype=torch.float32,
                                                  keep_codes=True)
    start = 0
    for i, end in enumerate(offsets.tolist()):
        if end > start:
            want, want_amax, q = quantize_values(x[start:end], dtype=torch.float32, keep_codes=True)
            assert torch.equal(values[start:end], want) and torch.equal(codes[start:end], q.data)
            assert torch.equal(amax[i], want_amax) and torch.equal(scale[start:end].view(torch.uint8),
                                                                   q.scale.view(torch.uint8))
        else:
            assert amax[i] == 0  # an expert without tokens
        start = end


def test_a_non_finite_group_is_poisoned_alone() -> None:
    x = torch.randn(30, 32)
    x[12, 5] = float("inf")
    offsets = torch.tensor([10, 20, 30])
    values, amax, _, _ = quantize_grouped(x, group_rows(offsets, 30), 3)
    assert amax[1].isnan() and values[10:20].isnan().all()
    assert torch.isfinite(amax[[0, 2]]).all()
    assert torch.isfinite(values[:10]).all() and torch.isfinite(values[20:]).all()


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_agreed_amaxes_as_the_per_expert_quantizer_gives(block: str) -> None:
    """Stacked expert weights [E*N, K], each with its own (ZeRO-agreed) amax: what quantize() gives per expert."""
    w = torch.randn(3 * 32, 48)
    agreed = w.view(3, -1).abs().amax(1) * torch.tensor([1.0, 1.5, 2.0])
    rows = torch.arange(3).repeat_interleave(32)
    _, used, codes, scale = quantize_grouped(w, rows, 3, block=block, amax=agreed, keep_codes=True)
    per = scale.shape[0] // 3
    for e in range(3):
        q = quantize(w[32 * e:32 * (e + 1)], block=block, amax=agreed[e].reshape(()))
        assert torch.equal(codes[32 * e:32 * (e + 1)], q.data) and torch.equal(used[e], q.amax)
        assert torch.equal(scale[per * e:per * (e + 1)].view(torch.uint8), q.scale.view(torch.uint8))


def test_group_rows_needs_no_host_read_and_clamps_the_tail() -> None:
    assert group_rows(torch.tensor([2, 2, 5]), 7).tolist() == [0, 0, 2, 2, 2, 2, 2]
