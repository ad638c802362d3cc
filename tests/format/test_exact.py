"""Bit-exact agreement of ds_nvfp4.quantize/dequantize with the reference on adversarial inputs."""

from __future__ import annotations

import pytest
import torch

import ds_nvfp4
from ds_nvfp4.format import _kernels, e2m1
from tests.reference import all_e4m3_values, ref_codes, ref_dequantize, ref_quantize

M, K = 64, 256


def _per_block_scaled(gen: torch.Generator) -> torch.Tensor:
    """Block magnitudes spanning 1e-8..1 (16x16 tiles and 1x16 blocks alike): E4M3 subnormal and zero scales."""
    x = torch.randn(M, K, generator=gen)
    mags = 10.0 ** torch.empty(M // 16, K // 16).uniform_(-8, 0, generator=gen)
    x = x * mags.repeat_interleave(16, 0).repeat_interleave(16, 1)
    row = 10.0 ** torch.empty(M, K // 16).uniform_(-8, 0, generator=gen)
    return x * row.repeat_interleave(16, 1)


def _ties() -> torch.Tensor:
    """Values landing exactly on every E2M1 midpoint: amax 2688 makes S_enc = 1, block scales powers of 2."""
    x = torch.zeros(M, K)
    x[0, 0] = 2688.0  # tensor amax; its block scale is 448
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    for r in range(1, M):
        s = 2.0 ** (r % 12 - 6)
        for b in range(K // 16):
            blk = torch.zeros(16)
            blk[0] = 6.0
            blk[1:15] = mids.roll(b)
            x[r, b * 16:(b + 1) * 16] = blk * s
    return x


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {
        "randn": torch.randn(M, K, generator=g),
        "cauchy": torch.empty(M, K).cauchy_(generator=g),
        "lognormal": torch.empty(M, K).log_normal_(0.0, 3.0, generator=g) * torch.randn(M, K, generator=g).sign(),
        "outliers": torch.randn(M, K, generator=g).index_put_((torch.tensor([3, 40]), torch.tensor([17, 200])),
                                                              torch.tensor([3e4, -1e5])),
        "block_scales_1e-8..1": _per_block_scaled(g),
        "zeros": torch.zeros(M, K),
        "tiny_1e-30": torch.randn(M, K, generator=g) * 1e-30,
        "denormal_fp32": torch.randn(M, K, generator=g) * 1e-40,
        "ties": _ties(),
        "signed_zeros": torch.where(torch.rand(M, K, generator=g) < 0.5, -0.0, 0.0) * torch.ones(M, K),
    }
    return out


INPUTS = _inputs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", ["1x16", "16x16"])
@pytest.mark.parametrize("name", list(INPUTS))
def test_quantize_matches_reference(name: str, block: str, dtype: torch.dtype) -> None:
    x = INPUTS[name].to(dtype)
    q = ds_nvfp4.quantize(x, block=block)
    packed, sb, amax = ref_quantize(x, block)
    assert torch.equal(q.data, packed), f"codes differ on {name}"
    assert torch.equal(q.scale.view(torch.uint8), sb.view(torch.uint8)), f"scales differ on {name}"
    assert torch.equal(q.amax, amax)
    ref = ref_dequantize(packed, sb, amax, block)
    assert torch.equal(q.dequantize(torch.float32), ref)
    assert torch.equal(q.dequantize(torch.bfloat16), ref.to(torch.bfloat16))


def test_inputs_exercise_the_hard_cases() -> None:
    """Guard the fixtures themselves: subnormal and zero E4M3 scales, ties, saturation all occur."""
    q = ds_nvfp4.quantize(INPUTS["block_scales_1e-8..1"])
    s = q.scale.to(torch.float32)
    assert ((s > 0) & (s < 2.0**-6)).any() and (s == 0).any()
    ties = ds_nvfp4.quantize(INPUTS["ties"]).codes()
    # every midpoint went to the even code: no odd magnitude code appears except 7 (the 6.0 anchors)
    assert set(ties.unique().tolist()) == {0, 2, 4, 6, 7, 8, 10, 12, 14}


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_given_amax_is_used(block: str) -> None:
    x = INPUTS["randn"]
    amax = x.abs().max() * 3
    q = ds_nvfp4.quantize(x, block=block, amax=amax)
    packed, sb, _ref_amax = ref_quantize(x, block, amax=amax)
    assert torch.equal(q.amax, amax) and torch.equal(q.data, packed)
    assert torch.equal(q.scale.view(torch.uint8), sb.view(torch.uint8))


def test_e2m1_rounding_table_from_the_note() -> None:
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1e9, 0.2500001, 0.7499999])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.5, 0.5])
    assert torch.equal(e2m1.decode(e2m1.encode_rne(y)), want)
    assert torch.equal(e2m1.decode(e2m1.encode_rne(-y)), -want)
    assert torch.equal(e2m1.encode_rne(y), ref_codes(y))


def test_torch_e4m3_cast_is_round_nearest_even() -> None:
    """The whole format leans on torch's float->e4m3 cast; check it against the list of E4M3 values."""
    vals = all_e4m3_values()
    pos = vals[vals >= 0].unique()
    mids = (pos[:-1] + pos[1:]) / 2
    probes = torch.cat([pos, mids, torch.nextafter(mids, pos[1:]), torch.nextafter(mids, pos[:-1])])
    got = probes.to(torch.float8_e4m3fn).to(torch.float32)
    idx = torch.searchsorted(pos, probes).clamp(1, len(pos) - 1)
    lo, hi = pos[idx - 1], pos[idx]
    exact = pos[torch.searchsorted(pos, probes).clamp(max=len(pos) - 1)] == probes
    d_lo, d_hi = probes - lo, hi - probes
    lo_code = (torch.searchsorted(pos, lo)).remainder(2) == 0  # even mantissa LSB <=> even index among positives
    want = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo_code, lo, hi)))
    want = torch.where(exact, probes, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("block", ["1x16", "16x16"])
@pytest.mark.parametrize("name", ["randn", "cauchy", "block_scales_1e-8..1", "ties"])
def test_compiled_kernels_equal_eager(name: str, block: str) -> None:
    """The torch.compile fast path (default on CPU) gives the eager kernels' bits."""
    x = INPUTS[name].to(torch.bfloat16)
    _amax_e, sb_e, enc_e = _kernels.block_scales.fn(x, block, None)
    data_e = _kernels.encode_nearest.fn(x, enc_e, block)
    q = ds_nvfp4.quantize(x, block=block)
    assert torch.equal(q.data, data_e)
    assert torch.equal(q.scale.view(torch.uint8), sb_e.view(torch.uint8))
    assert torch.equal(q.dequantize(), _kernels.decode.fn(q.data, q.scale, q.amax, block, torch.bfloat16))


def test_leading_dims_and_nbytes() -> None:
    x = torch.randn(2, 3, 5, 64)
    q = ds_nvfp4.quantize(x)
    assert q.data.shape == (2, 3, 5, 32) and q.scale.shape == (2, 3, 5, 4) and q.amax.shape == ()
    assert q.nbytes == 2 * 3 * 5 * (32 + 4) + 4
    packed, _, _ = ref_quantize(x.reshape(-1, 64))
    assert torch.equal(q.data.reshape(-1, 32), packed)
    assert q.dequantize().shape == x.shape


def test_non_contiguous_input() -> None:
    x = torch.randn(64, 128)
    assert torch.equal(ds_nvfp4.quantize(x.t().contiguous()).data, ds_nvfp4.quantize(x.t()).data)


def test_transpose_of_16x16_is_exact() -> None:
    x = INPUTS["cauchy"]
    q = ds_nvfp4.quantize(x, block="16x16")
    qt = q.t()
    assert torch.equal(qt.dequantize(torch.float32), q.dequantize(torch.float32).t())
    packed, sb, _ = ref_quantize(x.t().contiguous(), "16x16")
    assert torch.equal(qt.data, packed) and torch.equal(qt.scale.view(torch.uint8), sb.view(torch.uint8))
    with pytest.raises(ValueError, match="16x16"):
        ds_nvfp4.quantize(x).t()


def test_rowwise_scale_replicates_tiles() -> None:
    q = ds_nvfp4.quantize(INPUTS["randn"], block="16x16")
    rs = q.rowwise_scale()
    assert rs.shape == (M, K // 16)
    assert torch.equal(rs[5].view(torch.uint8), q.scale[0].view(torch.uint8))
    assert torch.equal(rs[16].view(torch.uint8), q.scale[1].view(torch.uint8))
