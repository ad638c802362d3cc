"""NVFP4Linear numerics: exact forward, the bf16 backward, the FP4 backward's expectation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ds_nvfp4
from ds_nvfp4.format import WeightScaling
from ds_nvfp4.kernels import operand
from ds_nvfp4.nn import NVFP4Linear, Recipe
from tests.reference import bf16_ulp, emulated_contract_bound, ref_fp4_gemm


def _operand_mode(monkeypatch, mode: str):
    monkeypatch.setenv(operand.ENV, mode)
    operand.reset()
    yield
    monkeypatch.undo()
    operand.reset()


@pytest.fixture
def fp32_operands(monkeypatch):
    """The emulation's bit-exact mode (FP32 GEMM operands), whatever this CPU's default."""
    yield from _operand_mode(monkeypatch, "fp32")


@pytest.fixture
def bf16_operands(monkeypatch):
    yield from _operand_mode(monkeypatch, "bf16")


def make(k: int = 64, n: int = 48, bias: bool = True, dtype=torch.float32, **recipe) -> NVFP4Linear:
    return NVFP4Linear(k, n, bias=bias, dtype=dtype, recipe=Recipe(**recipe))


@pytest.mark.parametrize("block", ["16x16", "1x16"])
@pytest.mark.parametrize("lead", [(37,), (2, 5), (1,), (3, 1, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_bit_exact(block: str, lead: tuple, dtype: torch.dtype, fp32_operands) -> None:
    lin = make(weight_block=block, dtype=dtype)
    x = torch.randn(*lead, 64, dtype=dtype)
    out = lin(x)
    ref = ref_fp4_gemm(x.reshape(-1, 64), lin.weight.detach(), "1x16", block) + lin.bias.detach().float()
    assert out.dtype == dtype and out.shape == (*lead, 48)
    assert torch.equal(out.reshape(-1, 48), ref.to(dtype))


@pytest.mark.parametrize("bound", [256, 448])
@pytest.mark.parametrize("block", ["16x16", "1x16"])
def test_4over6_weights_forward_and_backward_are_bit_exact(bound: int, block: str, fp32_operands) -> None:
    """precision.weights.scaling "4over6": the forward multiplies the 4/6 codes of the weight (format-level 4/6 is
    checked against TE's reference in tests/format/test_four_over_six.py) with alpha over 6 * bound, and the BF16
    backward multiplies that same dequantized weight."""
    from tests.reference import ref_block_values, ref_quantize

    lin = make(k=64, n=48, weight_block=block, weight=WeightScaling("4over6", bound))
    with torch.no_grad():  # tiles of very different magnitude, so that both candidates are chosen
        lin.weight.mul_(torch.exp(torch.randn(3, 4) * 2).repeat_interleave(16, 0).repeat_interleave(16, 1))
    w = lin.weight.detach()
    x = torch.randn(37, 64, requires_grad=True)
    out = lin(x)
    qw = ds_nvfp4.quantize(w, block=block, scaling="4over6", e4m3_bound=bound)
    standard = ds_nvfp4.quantize(w, block=block)
    assert not torch.equal(qw.codes(), standard.codes())  # 4/6 changed some blocks
    pa, sa, aa = ref_quantize(x.detach(), "1x16")
    vw = ds_nvfp4.format.e2m1.decode(qw.codes()).float() * qw.rowwise_scale().float().repeat_interleave(16, 1)
    acc = ref_block_values(pa, sa, "1x16") @ vw.t()
    ref = acc * ((aa * qw.amax) * torch.tensor(1.0 / (2688.0 * 6.0 * bound))) + lin.bias.detach()
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    want_dx = (g.to(torch.bfloat16) @ qw.dequantize(torch.bfloat16)).float()
    assert torch.equal(x.grad, want_dx)


@pytest.mark.parametrize("block", ["16x16", "1x16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_with_bf16_operands_keeps_the_contract(block: str, dtype: torch.dtype, bf16_operands) -> None:
    """BF16 GEMM operands: within one BF16 ulp of the FP32-accumulated result (plus summation order), then the one
    rounding to the output dtype."""
    lin = make(k=256, n=64, weight_block=block, dtype=dtype)
    x = torch.randn(37, 256, dtype=dtype) * 4
    out = lin(x).detach().float()
    ref, bound = emulated_contract_bound(x, lin.weight.detach(), "1x16", block)
    ref = ref + lin.bias.detach().float()
    if dtype == torch.bfloat16:
        bound = bound + 0.5 * bf16_ulp(ref)  # the output rounding itself
    err = (out - ref).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3f}"


def test_state_dict_and_parameters_are_a_linears() -> None:
    lin = torch.nn.Linear(32, 16)
    sd = {k: v.clone() for k, v in lin.state_dict().items()}
    w = lin.weight
    NVFP4Linear.from_linear(lin, Recipe())
    assert isinstance(lin, NVFP4Linear) and lin.weight is w
    assert lin.state_dict().keys() == sd.keys()
    lin.load_state_dict(sd)


def test_autocast_output_dtype(fp32_operands) -> None:
    lin = make()
    x = torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x)
    assert out.dtype == torch.bfloat16
    ref = ref_fp4_gemm(x, lin.weight.detach()) + lin.bias.detach().float()
    assert torch.equal(out, ref.to(torch.bfloat16))


@pytest.mark.parametrize("hadamard", [False, True])
def test_bf16_backward_uses_the_forward_weight(hadamard: bool) -> None:
    """dX = dY @ W' and dW = dY^T @ X with BF16 operands, W' the dequantized weight the forward multiplied."""
    lin = make(act_hadamard=hadamard)
    x = torch.randn(37, 64, requires_grad=True)
    g = torch.randn(37, 48)
    lin(x).backward(g)
    w = lin.weight.detach()
    wq = ds_nvfp4.quantize(ds_nvfp4.hadamard(w) if hadamard else w, block="16x16").dequantize(torch.bfloat16)
    w_used = ds_nvfp4.inverse_hadamard(wq) if hadamard else wq
    gb = g.to(torch.bfloat16)
    assert torch.equal(x.grad, (gb @ w_used).float())
    assert torch.equal(lin.weight.grad, (gb.t() @ x.detach().to(torch.bfloat16)).float())
    assert torch.equal(lin.bias.grad, g.sum(0))
    # which is plain autograd through the dequantized weight in bf16
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    wb = w_used.clone().requires_grad_()
    F.linear(xb, wb).backward(g.to(torch.bfloat16))
    assert torch.equal(x.grad.to(torch.bfloat16), xb.grad)
    assert torch.equal(lin.weight.grad.to(torch.bfloat16), wb.grad)


def test_fp4_backward_is_unbiased() -> None:
    """FP4 Dgrad with stochastically rounded dY: E[dX] equals the bf16 recipe's dX (same weight codes).
    FP4 Wgrad (RHT + SR on dY^T, nearest on X^T): E[dW] equals dY^T @ X' where X' is the RHT-quantized input."""
    torch.manual_seed(0)
    lin = make(bias=False, backward_gemm="nvfp4")
    bf = make(bias=False)
    bf.load_state_dict(lin.state_dict())
    x = torch.randn(40, 64)
    g = torch.randn(40, 48)
    n = 300
    dxs, dws = [], []
    for _ in range(n):
        xi = x.clone().requires_grad_()
        lin.weight.grad = None
        lin(xi).backward(g)
        dxs.append(xi.grad)
        dws.append(lin.weight.grad.clone())
    dx, dw = torch.stack(dxs), torch.stack(dws)
    # E[Q_sr(dY)] = dY except where a block maximum saturates at 6 (clamped, as with nearest rounding)
    q = ds_nvfp4.quantize(g)
    unit = q.rowwise_scale().float().repeat_interleave(16, 1) * q.amax / 2688
    g_expected = g.sign() * torch.minimum(g.abs(), 6 * unit)
    w_used = ds_nvfp4.quantize(lin.weight.detach(), block="16x16").dequantize(torch.float32)
    want_dx = g_expected @ w_used
    se_x = dx.std(0) / math.sqrt(n)
    assert ((dx.mean(0) - want_dx).abs() <= 5 * se_x + 1e-4 * want_dx.abs().max()).float().mean() > 0.999
    # which is the bf16 recipe's dX up to those saturated entries
    xr = x.clone().requires_grad_()
    bf(xr).backward(g)
    assert (dx.mean(0) - xr.grad).norm() / xr.grad.norm() < 0.02
    # E[dW]: dY^T H (Q(X^T H))^T with X^T padded to 48 tokens
    xp = torch.cat([x, x.new_zeros(8, 64)])
    gp = torch.cat([g, g.new_zeros(8, 48)])
    xq = ds_nvfp4.quantize(ds_nvfp4.hadamard(xp.t().contiguous())).dequantize(torch.float32)
    gh = ds_nvfp4.hadamard(gp.t().contiguous()).float()
    qg = ds_nvfp4.quantize(gh)
    unit = qg.rowwise_scale().float().repeat_interleave(16, 1) * qg.amax / 2688
    want = (gh.sign() * torch.minimum(gh.abs(), 6 * unit)) @ xq.t()
    se_w = dw.std(0) / math.sqrt(n)
    assert ((dw.mean(0) - want).abs() <= 5 * se_w + 1e-4 * want.abs().max()).float().mean() > 0.999
    # and it is close to the exact gradient (X's rounding error only)
    assert (dw.mean(0) - g.t() @ x).norm() / (g.t() @ x).norm() < 0.15


def test_fp4_backward_deterministic_without_sr() -> None:
    lin = make(backward_gemm="nvfp4", stochastic_rounding=False)
    x = torch.randn(20, 64, requires_grad=True)
    lin(x).sum().backward()
    g1 = x.grad.clone()
    x.grad = None
    lin(x).sum().backward()
    assert torch.equal(x.grad, g1)


@pytest.mark.parametrize("recipe", [dict(), dict(backward_gemm="nvfp4"), dict(act_hadamard=True),
                                    dict(weight_block="1x16")])
def test_tiny_model_trains(recipe: dict) -> None:
    """A 2-layer MLP regression: loss falls by more than half in 150 AdamW steps with each recipe."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(make(32, 64, **recipe), torch.nn.GELU(), make(64, 16, **recipe))
    x = torch.randn(256, 32)
    y = torch.sin(x[:, :16] * 2) + x[:, 16:] ** 2 / 4
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10, losses[::15]


def test_shape_errors_name_the_shape() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        make(k=24)(torch.randn(3, 24))


@pytest.mark.parametrize("backward_gemm", ["bf16", "nvfp4"])
def test_only_the_needed_gradients(backward_gemm: str) -> None:
    """Input without grad and no bias: the backward op returns empty placeholders for dX and db."""
    lin = make(bias=False, backward_gemm=backward_gemm)
    x = torch.randn(9, 64)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.shape == (48, 64)
    lin.weight.requires_grad_(False)
    xg = x.clone().requires_grad_()
    lin(xg).sum().backward()
    assert xg.grad.shape == x.shape


def test_tracked_statistics_hold_no_autograd_graph() -> None:
    """input_amax and the non-finite flag are running statistics over steps: if they kept the forward's graph,
    every step's graph (with its saved activations) would stay alive through the next (a leak that grew a 5M-model
    rank from 0.86 to 1.27 GB over 50 steps and slowed it down)."""
    lin = make()
    for _ in range(3):
        x = torch.randn(8, 64, requires_grad=True)
        lin(x).sum().backward()
    assert lin.input_amax.grad_fn is None and not lin.input_amax.requires_grad
    assert lin.nonfinite.grad_fn is None


def test_weight_cache_reuses_codes_until_the_weight_changes() -> None:
    """Off by default (no engine to say when weights change): one quantization per forward. On: reused until an
    in-place change through the parameter or ``WeightCodes.invalidate`` (what the engine calls after a step)."""
    lin = make()
    x = torch.randn(8, 64)
    lin(x), lin(x)
    assert lin.weight_quantizations == 2
    lin.weight_codes.cache = True
    first = lin(x)
    again = lin(x)
    assert lin.weight_quantizations == 3 and torch.equal(first, again)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # bumps the parameter's version counter
    changed = lin(x)
    assert lin.weight_quantizations == 4 and not torch.equal(changed, first)
    lin.weight_codes.invalidate()
    lin(x)
    assert lin.weight_quantizations == 5
    other = make()  # another layer's invalidation (another engine's step) leaves this cache alone
    other.weight_codes.invalidate()
    lin(x)
    assert lin.weight_quantizations == 5


def test_gathered_codes_are_used_until_the_weight_changes_in_place() -> None:
    """The packed ZeRO-3 storage offers the codes it gathered (``all_gather: "nvfp4"``); the forward uses them while
    the gathered weight is unchanged, and quantizes the weight again after an in-place change through the
    parameter (e.g. inside ``GatheredParameters(modifier_rank=0)``)."""
    from ds_nvfp4.nn.ops import fp4_linear

    lin = make()
    x = torch.randn(8, 64)
    doubled = ds_nvfp4.quantize(2 * lin.weight.detach(), block="16x16")  # codes of another weight: visible if used
    lin.weight_codes.offer_gathered(lin.weight, (doubled.data, doubled.scale, doubled.amax))
    used = lin(x)
    assert torch.equal(used, fp4_linear(x, 2 * lin.weight.detach(), lin.bias, lin.recipe))
    assert lin.weight_quantizations == 0
    with torch.no_grad():
        lin.weight[0, :16] = 0.5
    changed = lin(x)
    assert lin.weight_quantizations == 1
    assert torch.equal(changed, fp4_linear(x, lin.weight, lin.bias, lin.recipe))
    lin.weight_codes.drop_gathered()
    assert lin.weight_codes.reuse(lin.weight) is None
