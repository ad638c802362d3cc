"""4/6 block scaling pinned to Transformer Engine's definition, bit for bit.

The oracle below transcribes TE's reference (``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``,
``NVFP4QuantizerRef._quantize_blockwise_4over6_reference`` and ``_sum_4over6_2d_error``, TE 2.17+, read with
``fetch`` at commit d0067d0): per-row block amaxes (16x16 tiles replicated over their rows), the global encode
scale ``bound * 6 / amax``, candidate scales ``e4m3(clamp(1.5 * base))`` and ``e4m3(clamp(base))`` with
``base = (vec_max / 6) * S_enc``, TE's threshold table for E2M1 (``cast_to_fp4x2``), errors in the input domain
accumulated element by element, 16x16 row errors reduced pairwise, ties to map-to-6. It is written row by row
with Python loops, deliberately unlike the vectorised implementation it checks.
"""

from __future__ import annotations

import pytest
import torch

import ds_nvfp4

F32 = torch.float32
FLT_MAX = torch.finfo(F32).max


def _te_fp4_code(v: float) -> int:
    """TE's ``cast_to_fp4x2`` thresholds for one clamped value (its table, not a rounding rule)."""
    a = abs(v)
    mag = (0 if a <= 0.25 else 1 if a < 0.75 else 2 if a <= 1.25 else 3 if a < 1.75 else 4 if a <= 2.5
           else 5 if a < 3.5 else 6 if a <= 5.0 else 7)
    return mag | (8 if v < 0 else 0)


VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def te_4over6(x: torch.Tensor, block: str, bound: int, metric: str, amax: torch.Tensor | None = None):
    """(codes uint8 [M, K], scales float8 per row [M, K/16], amax) the way TE's reference computes them."""
    xf = x.to(F32)
    m, k = xf.shape
    nb = k // 16
    if block == "16x16":
        tiles = xf.abs().unfold(0, 16, 16).unfold(1, 16, 16).amax(dim=(-1, -2))
        vec_max = tiles.repeat_interleave(16, dim=0)
    else:
        vec_max = xf.abs().view(m, nb, 16).amax(dim=-1)
    g_amax = xf.abs().amax() if amax is None else amax.reshape(())
    ges = torch.div(torch.tensor(float(bound), dtype=F32) * torch.tensor(6.0, dtype=F32), g_amax)
    ges = torch.minimum(ges, torch.tensor(FLT_MAX, dtype=F32))
    if ges == 0:
        ges = torch.tensor(1.0, dtype=F32)
    gds = torch.div(torch.tensor(1.0, dtype=F32), ges)
    base = torch.div(vec_max, torch.tensor(6.0, dtype=F32)) * ges
    s4 = torch.clamp(base * 1.5, -448.0, 448.0).to(torch.float8_e4m3fn)
    s6 = torch.clamp(base, -448.0, 448.0).to(torch.float8_e4m3fn)
    denom = torch.tensor(6.0, dtype=F32) * torch.tensor(float(bound), dtype=F32)
    codes = {}, {}
    errs = torch.zeros(2, m, nb, dtype=F32)
    for c, s in enumerate((s4, s6)):
        enc = torch.minimum(torch.div(1.0, s.to(F32) * gds), torch.tensor(FLT_MAX, dtype=F32))
        for r in range(m):
            for b in range(nb):
                err = torch.zeros((), dtype=F32)
                for i in range(16):
                    v = torch.clamp(xf[r, b * 16 + i] * enc[r, b], -6.0, 6.0)
                    code = _te_fp4_code(float(v))
                    codes[c][r, b * 16 + i] = code
                    val = torch.tensor(VALUES[code], dtype=F32) * s[r, b].to(F32)
                    val = val * g_amax
                    val = val / denom
                    diff = val - xf[r, b * 16 + i]
                    err = err + (diff * diff if metric == "MSE" else torch.abs(diff))
                errs[c, r, b] = err
    if block == "16x16":
        rows = errs.view(2, m // 16, 16, nb)
        rows = rows[:, :, 0:8] + rows[:, :, 8:16]
        rows = rows[:, :, 0:4] + rows[:, :, 4:8]
        rows = rows[:, :, 0:2] + rows[:, :, 2:4]
        tile = rows[:, :, 0] + rows[:, :, 1]
        pick4 = (tile[0] < tile[1]).repeat_interleave(16, dim=0)
    else:
        pick4 = errs[0] < errs[1]
    out = torch.zeros(m, k, dtype=torch.uint8)
    for r in range(m):
        for j in range(k):
            out[r, j] = codes[0 if pick4[r, j // 16] else 1][(r, j)]
    scale = torch.where(pick4, s4.to(F32), s6.to(F32)).to(torch.float8_e4m3fn)
    return out, scale, g_amax, pick4


def _data(seed: int, shape=(64, 64), dtype=F32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # 16x16 tiles of very different magnitude (some near the tensor amax), Gaussian within a tile
    mag = torch.exp(torch.randn(shape[0] // 16, shape[1] // 16, generator=g) * 2)
    x = torch.randn(shape, generator=g) * mag.repeat_interleave(16, 0).repeat_interleave(16, 1)
    return x.to(dtype)


@pytest.mark.parametrize("block", ["1x16", "16x16"])
@pytest.mark.parametrize("bound", [256, 448])
@pytest.mark.parametrize("metric", ["MAE", "MSE"])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_codes_and_scales_equal_te_reference(block: str, bound: int, metric: str, dtype: torch.dtype) -> None:
    x = _data(1 + bound + len(metric), dtype=dtype)
    want_codes, want_scale, want_amax, pick4 = te_4over6(x, block, bound, metric)
    got = ds_nvfp4.quantize(x, block=block, scaling="4over6", e4m3_bound=bound, error=metric)
    assert torch.equal(got.codes(), want_codes)
    assert torch.equal(got.rowwise_scale().view(torch.uint8), want_scale.view(torch.uint8))
    assert torch.equal(got.amax, want_amax) and got.e4m3_bound == bound
    if block == "1x16" or bound == 256:  # Gaussian 16x16 tiles at the 448 bound all keep map-to-6 here
        assert 0 < pick4.float().mean() < 1  # the data exercise both candidates


def test_given_amax_as_zero_shards_pass_it() -> None:
    x = _data(7)
    amax = torch.tensor(3.0 * float(x.abs().max()), dtype=F32)  # a larger agreed amax (another rank's)
    want_codes, want_scale, _, _ = te_4over6(x, "1x16", 256, "MAE", amax=amax)
    got = ds_nvfp4.quantize(x, scaling="4over6", amax=amax)
    assert torch.equal(got.codes(), want_codes) and torch.equal(got.amax, amax)
    assert torch.equal(got.scale.view(torch.uint8), want_scale.view(torch.uint8))


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_dequantize_uses_the_bound_and_4over6_errs_less_than_either_candidate_alone(block: str) -> None:
    x = _data(3)
    q = ds_nvfp4.quantize(x, block=block, scaling="4over6")
    vals = ds_nvfp4.format.e2m1.decode(q.codes()).float() * q.rowwise_scale().float().repeat_interleave(16, 1)
    want = (vals * (q.amax / 1536.0)).to(torch.bfloat16)
    assert torch.equal(q.dequantize(torch.bfloat16), want)
    # per block, 4/6 keeps the better of the two: never worse in total than standard NVFP4 at the same bound
    err_46 = (q.dequantize(F32) - x).abs().sum()
    only6 = ds_nvfp4.quantize(x, block=block)
    assert err_46 < (only6.dequantize(F32) - x).abs().sum()


def test_gemm_alpha_follows_each_operands_bound() -> None:
    from ds_nvfp4.kernels.base import global_alpha

    a = ds_nvfp4.quantize(_data(4), scaling="4over6")
    b = ds_nvfp4.quantize(_data(5))
    assert torch.equal(global_alpha(a, b), (a.amax * b.amax) * torch.tensor(1.0 / (1536.0 * 2688.0), dtype=F32))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"scaling": "4/6"}, "scaling='4/6': allowed values are '6', '4over6'"),
    ({"scaling": "4over6", "rounding": "stochastic"}, "rounding='nearest' only"),
    ({"scaling": "4over6", "e4m3_bound": 300}, "e4m3_bound=300: allowed values are 448, 256"),
    ({"scaling": "4over6", "error": "L1"}, "error='L1': allowed values are 'MAE', 'MSE'"),
    ({"e4m3_bound": 256}, "standard NVFP4 (scaling='6') uses 448"),
])
def test_bad_arguments_name_the_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ds_nvfp4.quantize(torch.randn(16, 16), **kwargs)


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_a_tie_keeps_map_to_6(block: str) -> None:
    """Values {0, +-1} with amax 1 are exact under both candidates (scales 256 and 384 at the 256 bound): equal
    errors, and TE keeps map-to-6 (``err_4 < err_6`` picks 4)."""
    x = torch.zeros(16, 32)
    x[:, ::3] = 1.0
    x[:, 1::5] = -1.0
    q = ds_nvfp4.quantize(x, block=block, scaling="4over6")
    assert torch.equal(q.scale.float(), torch.full_like(q.scale.float(), 256.0))
    assert torch.equal(q.dequantize(F32), x)
    _, want_scale, _, pick4 = te_4over6(x, block, 256, "MAE")
    assert not pick4.any() and torch.equal(q.rowwise_scale().float(), want_scale.float())


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "nvfp4-compressed-tensors"])
def test_an_export_of_4over6_weights_is_standard_nvfp4_to_a_reader(fmt: str) -> None:
    """The exported global scale divides by 6 * 256: a reader's decode (codes x block scale x global decode scale,
    the reciprocal for compressed-tensors' encode form) gives the trained values, to one float32 rounding."""
    from ds_nvfp4.export.formats import nvfp4_tensors

    q = ds_nvfp4.quantize(_data(11), block="16x16", scaling="4over6")
    t = nvfp4_tensors(fmt, "l", q, slice(0, 64), None)
    codes = t["l.weight" if fmt == "nvfp4-modelopt" else "l.weight_packed"]
    glob = t["l.weight_scale_2"] if fmt == "nvfp4-modelopt" else 1.0 / t["l.weight_global_scale"]
    vals = ds_nvfp4.format.e2m1.decode(ds_nvfp4.format.e2m1.unpack(codes)).float()
    got = vals * t["l.weight_scale"].float().repeat_interleave(16, 1) * glob
    assert torch.allclose(got, q.dequantize(F32), rtol=2 ** -22, atol=0)
    assert not torch.allclose(got * 1536.0 / 2688.0, q.dequantize(F32))  # not read as if the bound were 448


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_a_non_finite_element_poisons_a_4over6_tensor_also_with_a_given_finite_amax(block: str) -> None:
    """As standard NVFP4 does: a NaN/Inf in the data makes the amax NaN and every decoded value NaN, also when the
    amax comes from outside (ZeRO-3's agreed amax, a fused group's), which is finite."""
    import ds_nvfp4

    x = torch.randn(32, 64)
    x[5, 7] = float("nan")
    for scaling in ("4over6", "6"):
        q = ds_nvfp4.quantize(x, block=block, scaling=scaling, amax=torch.tensor(3.0))
        assert bool(q.nonfinite) and q.dequantize(torch.float32).isnan().all(), scaling
