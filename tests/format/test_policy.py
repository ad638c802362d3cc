"""NaN/Inf and -0.0 policy, and the errors users get for bad input."""

from __future__ import annotations

import pytest
import torch

import ds_nvfp4


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_nonfinite_input_poisons_the_whole_tensor(bad: float, block: str) -> None:
    x = torch.randn(32, 64)
    x[7, 9] = bad
    q = ds_nvfp4.quantize(x, block=block)
    assert bool(q.nonfinite)
    assert torch.isnan(q.dequantize(torch.float32)).all(), "a NaN must never become a finite weight"


def test_nonfinite_given_amax_poisons() -> None:
    q = ds_nvfp4.quantize(torch.randn(4, 32), amax=torch.tensor(float("nan")))
    assert bool(q.nonfinite) and torch.isnan(q.dequantize()).all()


def test_finite_input_is_not_flagged() -> None:
    assert not bool(ds_nvfp4.quantize(torch.randn(4, 32)).nonfinite)


def test_negative_zero_policy() -> None:
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1] = -0.0
    x[0, 2] = -1e-3  # rounds to zero, keeps the sign like the hardware and TE's reference
    x[0, 3] = 0.0
    codes = ds_nvfp4.quantize(x, amax=torch.tensor(6.0)).codes()[0]
    assert codes[:4].tolist() == [7, 8, 8, 0]


@pytest.mark.parametrize(
    "kwargs, shape, match",
    [
        ({}, (4, 24), r"\(4, 24\).*multiple of 16"),
        ({"block": "16x16"}, (8, 32), r"\(8, 32\).*16x16"),
        ({"block": "16x16"}, (2, 16, 32), r"16x16.*2-D"),
        ({"block": "32x32"}, (16, 32), "allowed values are '1x16', '16x16'"),
        ({"rounding": "up"}, (16, 32), "allowed values are 'nearest', 'stochastic'"),
        ({"amax": 3.0}, (16, 32), "amax must be a float32 tensor"),
    ],
)
def test_bad_input_names_the_rule(kwargs, shape, match) -> None:
    with pytest.raises(ValueError, match=match):
        ds_nvfp4.quantize(torch.randn(shape), **kwargs)


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ds_nvfp4.quantize(torch.randn(4, 32).half())
