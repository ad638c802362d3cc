"""Property tests (hypothesis) of the format: packing, idempotence, error bound, stochastic rounding, RHT."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ds_nvfp4
from ds_nvfp4.format import e2m1


@st.composite
def matrices(draw, rows_multiple: int = 1) -> torch.Tensor:
    """float32 [M, K], K a multiple of 16, magnitudes per row spanning many binades."""
    m = draw(st.integers(1, 4)) * rows_multiple
    k = 16 * draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    exps = draw(st.lists(st.integers(-20, 20), min_size=m, max_size=m))
    return x * (2.0 ** torch.tensor(exps, dtype=torch.float32)).unsqueeze(1)


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_pack_unpack_bijection(codes: list[int]) -> None:
    c = torch.tensor(codes, dtype=torch.uint8)
    assert torch.equal(e2m1.unpack(e2m1.pack(c)), c)
    b = torch.tensor(codes[: len(codes) // 2], dtype=torch.uint8) * 16 + torch.tensor(codes[len(codes) // 2:],
                                                                                     dtype=torch.uint8)
    assert torch.equal(e2m1.pack(e2m1.unpack(b)), b)


def test_encode_decode_every_code() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1.encode_rne(e2m1.decode(codes)), codes)


def _normal_scales(q: ds_nvfp4.NVFP4Storage, x: torch.Tensor) -> bool:
    """Every block scale is a normal E4M3 number, or zero for an all-zero block."""
    s = q.rowwise_scale().to(torch.float32)
    block_max = x.abs().reshape(x.shape[0], -1, 16).amax(-1)
    return bool(((s >= 2.0**-6) | ((s == 0) & (block_max == 0))).all())


@pytest.mark.parametrize("block", ["1x16", "16x16"])
@given(data=st.data())
def test_requantizing_the_dequantized_tensor_reproduces_it(block: str, data) -> None:
    """quantize(dequantize(q), amax=q.amax) == q, byte for byte, whenever every block scale is a normal
    E4M3 number. With a subnormal scale E4M3 rounding can move a block's maximum to code 6 (4.0), and a
    scale that underflows to zero saturates its codes while they decode to 0: the re-derived codes
    differ though the values do not. ZeRO storage therefore never re-quantizes dequantized values
    (it keeps the bytes), and this test pins exactly where idempotence holds."""
    x = data.draw(matrices(rows_multiple=16 if block == "16x16" else 1))
    q = ds_nvfp4.quantize(x, block=block)
    if not _normal_scales(q, x):
        return
    for dtype in (torch.float32, torch.bfloat16):
        q2 = ds_nvfp4.quantize(q.dequantize(dtype), block=block, amax=q.amax)
        assert torch.equal(q2.data, q.data)
        assert torch.equal(q2.scale.view(torch.uint8), q.scale.view(torch.uint8))


@pytest.mark.parametrize("block", ["1x16", "16x16"])
@given(data=st.data())
def test_error_bounded_by_half_a_step(block: str, data) -> None:
    """|x - x'| <= half the E2M1 spacing at |x| times the block's decode scale, except saturated values."""
    x = data.draw(matrices(rows_multiple=16 if block == "16x16" else 1))
    q = ds_nvfp4.quantize(x, block=block)
    deq = q.dequantize(torch.float32)
    # decode scale of each element: s_b * amax / 2688
    s = q.rowwise_scale().to(torch.float32).repeat_interleave(16, dim=1)
    unit = s * q.amax / 2688.0
    y = torch.where(unit > 0, x / unit, torch.zeros_like(x)).abs()
    half_step = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    saturated = y > 6.0
    err = (x - deq).abs()
    bound = half_step * unit * (1 + 1e-5) + 1e-30
    ok = (err <= bound) | saturated | (unit == 0)
    assert ok.all(), f"max excess {(err - bound)[~ok].max()}"
    # elements in a zero-scale block are flushed to zero, and only tiny blocks get a zero scale
    assert (deq[unit == 0] == 0).all()


@given(st.floats(min_value=-6.0, max_value=6.0, allow_nan=False, width=32))
def test_stochastic_rounding_brackets_and_is_unbiased(v: float) -> None:
    y = torch.full((20000,), v, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    codes = e2m1.encode_stochastic(y, torch.randint(0, 256, y.shape, dtype=torch.uint8, generator=g))
    vals = e2m1.decode(codes)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a = abs(v)
    lo = grid[grid <= a].max().item()
    hi = grid[grid >= a].min().item()
    assert set(vals.abs().unique().tolist()) <= {lo, hi}
    # Unbiased up to the 8-bit resolution of u (bias <= step/256) plus sampling noise (5 sigma).
    step = hi - lo
    sigma = step * 0.5 / math.sqrt(y.numel())
    assert abs(vals.mean().item() - v) <= step / 256 + 5 * sigma + 1e-7


def test_stochastic_quantize_is_unbiased_per_element() -> None:
    """E[dequant(quantize(x, stochastic))] == x element-wise within 5 standard errors.

    The standard error is the true one of a two-point rounding (``step * sqrt(p (1 - p)) / sqrt(n)``, p the position
    of x between its grid neighbours), not the sampled one: an element with p < 1/n is often never rounded up in n
    draws, its sampled deviation is then 0 and a sampled-std bound would fail it for no fault."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(3)
    n = 400
    acc = torch.zeros_like(x)
    for _ in range(n):
        d = ds_nvfp4.quantize(x, rounding="stochastic", generator=g).dequantize(torch.float32)
        acc += d
    mean = acc / n
    q = ds_nvfp4.quantize(x)
    unit = q.rowwise_scale().to(torch.float32).repeat_interleave(16, 1) * q.amax / 2688
    y = (x / unit).abs()
    step = torch.where(y < 2, 0.5, torch.where(y < 4, 1.0, 2.0))
    p = (y - torch.floor(y / step) * step) / step
    # floored at the 8-bit resolution of u: an element on a grid point in x/unit may sit a rounding error off it in
    # the encoder's x * enc_b, where it then rounds the other way with probability ~1/256
    std = step * (p * (1 - p)).clamp(min=1 / 256).sqrt() * unit
    tol = 5 * std / math.sqrt(n) + unit * 2 / 256 + 1e-6  # sampling + the 8-bit u resolution
    # Block maxima can sit just above 6 after the E4M3 rounding of their scale: they saturate, as with
    # nearest rounding. Everything else must be unbiased.
    inside = (x / unit).abs() <= 6.0
    assert inside.float().mean() > 0.9
    assert ((mean - x).abs() <= tol)[inside].all()


def test_stochastic_rounding_reproducible_with_generator() -> None:
    x = torch.randn(16, 64)
    a = ds_nvfp4.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(5))
    b = ds_nvfp4.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.data, b.data)


@given(data=st.data())
def test_hadamard_is_orthogonal(data) -> None:
    x = data.draw(matrices()).to(torch.bfloat16)
    y = ds_nvfp4.hadamard(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    back = ds_nvfp4.inverse_hadamard(y).to(torch.float32)
    xf = x.to(torch.float32)
    # two bf16 roundings (8-bit mantissa) of tile-norm-sized values: error <= 2^-7 of the tile's norm
    tile_norm = xf.reshape(-1, 16).norm(dim=1, keepdim=True).expand(-1, 16).reshape(x.shape)
    assert ((back - xf).abs() <= tile_norm * 2.0**-7).all()
    # energy is preserved per tile up to bf16 rounding
    yn = y.to(torch.float32).reshape(-1, 16).norm(dim=1)
    assert torch.allclose(yn, xf.reshape(-1, 16).norm(dim=1), rtol=2**-7, atol=0)


def test_hadamard_matrix_matches_te_definition() -> None:
    h = ds_nvfp4.format.rht_matrix().to(torch.float32)
    assert torch.equal(h @ h.t(), torch.eye(16))
    assert torch.equal(h[:, 0] * 4, torch.tensor(ds_nvfp4.format.RHT_SIGNS, dtype=torch.float32))
