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


def test_nan_payloads_compare_by_bits() -> None:
    a = torch.tensor([float("nan"), 1.0])
    assert _compile._same_bits(a, a.clone())
    assert not _compile._same_bits(a, torch.tensor([float("nan"), 2.0]))
    assert _compile._same_bits((a, torch.zeros(())), (a.clone(), torch.zeros(())))
