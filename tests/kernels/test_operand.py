"""The `emulated` backend's operand dtype per device, and its numerical contract (docs/format.md).

Products exact, FP32 accumulation; FP32 operands: bit for bit the reference; BF16 operands: within one BF16 ulp
of the FP32-accumulated reference (plus the bound of a different FP32 summation order).
"""

from __future__ import annotations

import pytest
import torch

import ds_nvfp4
from ds_nvfp4.kernels import operand as op
from ds_nvfp4.kernels.emulated import EmulatedBackend, reference
from tests.reference import emulated_contract_bound, ref_fp4_gemm

SHAPES = [(64, 32, 128), (37, 48, 64), (1, 16, 16), (256, 96, 1024)]


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 2)  # rows of varied scale
    b = torch.empty(n, k).cauchy_(generator=g)  # heavy tails: saturated and tiny blocks in one tensor
    return a, b


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_fp32_operands_are_bit_exact(m: int, n: int, k: int) -> None:
    a, b = _operands(m, n, k, 0)
    got = reference.mm(ds_nvfp4.quantize(a), ds_nvfp4.quantize(b, block="16x16"), torch.float32)
    assert torch.equal(got, ref_fp4_gemm(a, b))


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_operands_within_one_bf16_ulp(m: int, n: int, k: int, seed: int) -> None:
    a, b = _operands(m, n, k, seed)
    got = EmulatedBackend(torch.bfloat16).mm(ds_nvfp4.quantize(a), ds_nvfp4.quantize(b, block="16x16"),
                                             torch.float32)
    ref, bound = emulated_contract_bound(a, b)
    err = (got - ref).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3f}"


def test_bf16_operand_values_are_exact() -> None:
    """The BF16 operands equal the FP32 ones: a 6-bit value times an E4M3 scale never rounds in BF16."""
    x = torch.empty(64, 256).cauchy_(generator=torch.Generator().manual_seed(3))
    for block in ("1x16", "16x16"):
        q = ds_nvfp4.quantize(x, block=block)
        assert torch.equal(q.block_values(torch.bfloat16).float(), q.block_values(torch.float32))
        values, amax, kept = ds_nvfp4.quantize_values(x, block=block, dtype=torch.bfloat16, keep_codes=True)
        assert torch.equal(values.float(), q.block_values()) and torch.equal(amax, q.amax)
        assert torch.equal(kept.data, q.data) and torch.equal(kept.scale.view(torch.uint8), q.scale.view(torch.uint8))


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_backend_quantize_matches_format_quantize(block: str) -> None:
    """The fused quantize -> operand pass gives the operand of ds_nvfp4.quantize, for every rounding."""
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        be = EmulatedBackend(dtype)
        o = be.quantize(x, block=block, keep_codes=True)
        q = ds_nvfp4.quantize(x, block=block)
        assert o.values.dtype == dtype and torch.equal(o.values.float(), q.block_values())
        assert torch.equal(o.tensor.data, q.data)
        torch.manual_seed(7)
        sr = be.quantize(x, block=block, rounding="stochastic")
        torch.manual_seed(7)
        want = ds_nvfp4.quantize(x, block=block, rounding="stochastic")
        assert torch.equal(sr.values.float(), want.block_values())


def test_transposed_operand_is_exact() -> None:
    w = torch.randn(48, 64)
    q = ds_nvfp4.quantize(w, block="16x16")
    for be in (reference, EmulatedBackend(torch.bfloat16)):
        assert torch.equal(be.operand(q).t().values.float(), q.t().block_values())


def _cpu(monkeypatch, cap: str | None):
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)


def test_decide_rules(monkeypatch) -> None:
    assert op.decide("cuda", (9, 0), "auto").dtype == torch.bfloat16       # Hopper: BF16 tensor cores
    assert op.decide("cuda", (8, 0), "auto").dtype == torch.bfloat16
    assert op.decide("cuda", (7, 0), "auto").dtype == torch.float32        # Volta: no BF16 tensor cores
    assert op.decide("cuda", (9, 0), "fp32").dtype == torch.float32        # the bit-exact mode, on request
    assert op.decide("cpu", None, "bf16").dtype == torch.bfloat16
    _cpu(monkeypatch, "AVX512_CORE")                                       # oneDNN capped below BF16: FP32
    c = op.decide("cpu", None, "auto")
    assert c.dtype == torch.float32 and "AVX512_CORE" in c.reason
    _cpu(monkeypatch, None)
    import torch.cpu as tc

    units = tc._is_amx_tile_supported() or tc._is_avx512_bf16_supported()
    assert op.decide("cpu", None, "auto").dtype == (torch.bfloat16 if units else torch.float32)
    with pytest.raises(ValueError, match="DS_NVFP4_EMULATED_OPERAND='tf32': allowed values are auto, fp32, bf16"):
        op.decide("cpu", None, "tf32")


def test_environment_variable_and_report(monkeypatch) -> None:
    monkeypatch.setenv(op.ENV, "fp32")
    op.reset()
    try:
        sel = ds_nvfp4.kernels.select(None, smoke=False)
        assert sel.name == "emulated" and "FP32 operands" in sel.operand and "bit-exact" in sel.describe()
        lin = ds_nvfp4.nn.NVFP4Linear(64, 32)
        x = torch.randn(5, 64)
        assert torch.equal(lin(x).detach(), (ref_fp4_gemm(x, lin.weight.detach()) + lin.bias.detach()))
    finally:
        monkeypatch.delenv(op.ENV)
        op.reset()
