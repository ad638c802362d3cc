"""The compiled-kernel guard: a compiled kernel whose bits differ from eager is never used, and that is reported."""

from __future__ import annotations

import logging

import torch

from ds_nvfp4.format import _compile


def test_a_miscompiled_kernel_falls_back_to_eager_and_is_reported(monkeypatch, caplog) -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    monkeypatch.setattr(_compile, "_EAGER", {})
    monkeypatch.setattr(_compile, "compile_enabled", lambda device: True)
    kernel = _compile._Compiled(double)
    kernel.compiled = lambda x: x * 2 + (x > 0)  # what a wrong Inductor kernel would return
    x = torch.tensor([1.0, -1.0, 3.0])
    with caplog.at_level(logging.WARNING, logger="ds_nvfp4"):
        out = kernel(x)
    assert torch.equal(out, x * 2)  # the eager result, not the compiled one
    assert kernel.failed and "double" in _compile.status()
    assert "gives different bits from the eager kernel" in caplog.text
    assert torch.equal(kernel(x), x * 2)  # and eager from then on


def test_a_correct_kernel_is_verified_once_per_signature(monkeypatch) -> None:
    calls = {"eager": 0}

    def square(x: torch.Tensor) -> torch.Tensor:
        calls["eager"] += 1
        return x * x

    monkeypatch.setattr(_compile, "compile_enabled", lambda device: True)
    kernel = _compile._Compiled(square)
    kernel.compiled = lambda x: x * x
    for _ in range(3):
        kernel(torch.ones(4))
    kernel(torch.ones(5))
    assert calls["eager"] == 2 and not kernel.failed  # one check for each of the two shapes


def test_bits_compare_exactly_except_nan_payloads() -> None:
    a = torch.tensor([float("nan"), 1.0])
    assert _compile._same_bits(a, a.clone())
    assert not _compile._same_bits(a, torch.tensor([float("nan"), 2.0]))
    assert not _compile._same_bits(a, torch.tensor([0.0, 1.0]))
    assert not _compile._same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))  # the sign of zero is data
    assert _compile._same_bits(a, torch.tensor([-float("nan"), 1.0]))      # the sign of a NaN is not
    assert _compile._same_bits(a.bfloat16(), torch.tensor([-float("nan"), 1.0]).bfloat16())
    assert _compile._same_bits((a, torch.zeros(())), (a.clone(), torch.zeros(())))


def test_a_wrong_native_twin_falls_back_to_inductor_or_eager(monkeypatch) -> None:
    monkeypatch.setattr(_compile, "_EAGER", {})
    monkeypatch.setattr(_compile, "compile_enabled", lambda device: True)
    kernel = _compile._Compiled(lambda x: x * 2, native=lambda x: x * 3)
    kernel.__name__ = "twice"
    kernel.compiled = lambda x: x * 2
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(kernel(x), x * 2) and kernel.native_failed and not kernel.failed
    assert any("C++" in k for k in _compile.status())
    assert torch.equal(kernel(x), x * 2)  # the (correct) compiled twin from then on


def test_non_finite_inputs_neither_verify_nor_condemn(monkeypatch) -> None:
    monkeypatch.setattr(_compile, "compile_enabled", lambda device: True)
    # a twin that differs only where the input is NaN (don't-care bits of a poisoned tensor)
    kernel = _compile._Compiled(lambda x: torch.nan_to_num(x, nan=0.0), native=lambda x: torch.nan_to_num(x, nan=1.0))
    bad = torch.tensor([float("nan"), 1.0])
    assert torch.equal(kernel(bad), torch.tensor([0.0, 1.0]))  # eager answer, nothing decided
    assert not kernel.native_failed and not kernel.verified
    good = torch.tensor([2.0, 1.0])
    assert torch.equal(kernel(good), good) and kernel.verified


def test_cpp_encode_matches_eager_bit_for_bit() -> None:
    """The C++ encode kernel on the inputs that stress rounding: ties, saturation, subnormal scales, -0, both
    dtypes and both block layouts (skips, saying why, where it cannot be built)."""
    import pytest

    from ds_nvfp4.format import _cpu_ext, _kernels

    ext = _cpu_ext.extension()
    if ext is None:
        pytest.skip(_cpu_ext.unavailable_reason or "no C++ extension")
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    for dtype in (torch.float32, torch.bfloat16):
        for block in ("1x16", "16x16"):
            x = torch.randn(64, 256, generator=g) * torch.logspace(-8, 0, 64).unsqueeze(1)
            x[0] = torch.cat([grid, -grid] * 8)   # exact ties after scaling by enc = 1 (amax 6 below)
            x[1, :16] = -0.0
            x[2] = torch.distributions.Cauchy(0.0, 1.0).sample((256,))
            x = x.to(dtype)
            enc = _kernels.scales(_kernels.block_amax(x, block), torch.tensor(6.0 * 448.0))[2]
            enc[0] = 1.0 if block == "1x16" else enc[0]
            want = _kernels.encode_nearest.fn(x, enc, block)
            got = ext.encode_nearest(x.contiguous(), enc.contiguous(), 1 if block == "1x16" else 16)
            assert torch.equal(got, want), (dtype, block)


def test_cpp_block_scales_match_eager_bit_for_bit() -> None:
    """The C++ block scales (a storage quantize's first step): both dtypes and layouts, subnormal and saturated
    scales, all-zero blocks, a given amax (float32 and bfloat16, zero, below max|x|) and a poisoned input."""
    import pytest

    from ds_nvfp4.format import _compile, _cpu_ext, _kernels

    if _cpu_ext.extension() is None:
        pytest.skip(_cpu_ext.unavailable_reason or "no C++ extension")
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        for block in ("1x16", "16x16"):
            x = torch.randn(64, 256, generator=g) * torch.logspace(-30, 2, 64).unsqueeze(1)
            x[3] = 0.0
            x[4, :16] = -0.0
            x = x.to(dtype)
            amaxes = (None, torch.tensor(3.0), torch.tensor(0.0), torch.tensor(1e-3, dtype=torch.bfloat16),
                      torch.tensor([250.0]))
            for amax in amaxes:
                want = _kernels.block_scales.fn(x, block, amax)
                got = _kernels._block_scales_cpp(x, block, amax)
                assert _compile._same_bits(got, want), (dtype, block, amax)
            bad = x.clone()
            bad[5, 7] = float("nan")
            used = _kernels._block_scales_cpp(bad, block, None)[0]
            assert torch.isnan(used) and torch.isnan(_kernels.block_scales.fn(bad, block, None)[0])


def test_cpp_decode_matches_eager_bit_for_bit() -> None:
    """The C++ decode kernel: every code, subnormal and saturated scales, -0 codes, bf16 and fp32 outputs."""
    import pytest

    from ds_nvfp4.format import _cpu_ext, _kernels

    ext = _cpu_ext.extension()
    if ext is None:
        pytest.skip(_cpu_ext.unavailable_reason or "no C++ extension")
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g)
    data[0] = torch.arange(128, dtype=torch.uint8) * 2 + 1  # includes every code in both nibbles
    for block, rows in (("1x16", 64), ("16x16", 4)):
        scale = (torch.rand(rows, 16, generator=g) * torch.logspace(-9, 2.65, rows).unsqueeze(1))
        scale = scale.to(torch.float8_e4m3fn)
        for amax in (torch.tensor(3.7), torch.tensor(1e-30), torch.tensor(3e38)):
            for dtype in (torch.bfloat16, torch.float32):
                want = _kernels.decode.fn(data, scale, amax, block, dtype)
                got = _kernels._decode_cpp(data, scale, amax, block, dtype)
                assert _compile._same_bits(got, want), (block, float(amax), dtype)
