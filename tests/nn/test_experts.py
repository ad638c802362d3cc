"""FP4 experts numerics against a per-expert pure-PyTorch reference: the grouped GEMM (nn/grouped.py), the
interface forward (nn/experts.py, with GPT-OSS's biased, transposed, interleaved layout) and intercepted forwards
(nn/intercept.py, Llama 4's bmm and DBRX's per-expert matmul): the same output bit for bit in the bit-exact mode,
each expert weighted by its own slot's router weight, and each expert's input amax its own."""

from __future__ import annotations

import copy

import pytest
import torch

from ds_nvfp4.nn import Recipe, convert_model
from ds_nvfp4.nn.grouped import grouped_fp4_linear
from tests.nn.test_linear import bf16_operands, fp32_operands  # noqa: F401  (operand modes, fixtures)
from tests.reference import ref_fp4_gemm

BLOCK = "16x16"  # the default weight block


def _ref_linear(x: torch.Tensor, w_nk: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's FP4 GEMM: ``x [M, K] @ w_nk[N, K].T`` (x quantized as one tensor: that expert's tokens)."""
    out = ref_fp4_gemm(x.float(), w_nk.float(), "1x16", BLOCK)
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("backward", ["bf16", "nvfp4"])
def test_grouped_linear_is_each_experts_fp4_linear(backward: str, fp32_operands) -> None:  # noqa: F811
    from ds_nvfp4.nn.ops import fp4_linear

    torch.manual_seed(0)
    e, n, k, sizes = 4, 32, 48, [5, 0, 17, 9]
    w = torch.randn(e, n, k, requires_grad=True)
    b = torch.randn(e, n, requires_grad=True)
    x = torch.randn(sum(sizes), k, requires_grad=True)
    offsets = torch.tensor(sizes).cumsum(0)
    recipe = Recipe(weight_block=BLOCK, backward_gemm=backward, stochastic_rounding=False)
    out, x_amax, bad, _ = grouped_fp4_linear(x, w, b, offsets, recipe)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = (x.grad.clone(), w.grad.clone(), b.grad.clone())
    x.grad = w.grad = b.grad = None
    start, parts = 0, []
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            parts.append(fp4_linear(x[start:end], w[g], b[g], recipe))
            assert torch.equal(out[start:end], _ref_linear(x[start:end].detach(), w[g].detach(), b[g].detach()))
            assert torch.equal(x_amax[g], x[start:end].detach().abs().max())
        else:
            assert x_amax[g] == 0
        start = end
    torch.cat(parts).backward(grad)
    assert not bad and torch.equal(out, torch.cat(parts))
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad) and torch.equal(got[2], b.grad)


@pytest.mark.parametrize("operands", ["fp32", "bf16"])
def test_grouped_linear_without_bias_is_each_experts_fp4_linear(operands: str, request) -> None:
    """Without a bias the grouped GEMM writes every expert's accumulator into one matrix and runs one epilogue with
    each row's expert's alpha: the same bits as each expert's own FP4 Linear (its own GEMM and epilogue), with BF16
    operands (oneDNN's BF16 result, this CPU's default) as with FP32 ones; empty experts first, inside and last."""
    from ds_nvfp4.nn.ops import fp4_linear

    request.getfixturevalue(f"{operands}_operands")
    torch.manual_seed(1)
    e, n, k, sizes = 6, 48, 64, [0, 7, 0, 33, 16, 0]
    w = torch.randn(e, n, k).to(torch.bfloat16).requires_grad_()
    x = (torch.randn(sum(sizes), k) * torch.logspace(-2, 2, sum(sizes)).unsqueeze(1)).to(torch.bfloat16)
    x.requires_grad_()
    offsets = torch.tensor(sizes).cumsum(0)
    recipe = Recipe(weight_block=BLOCK)
    out, _, bad, _ = grouped_fp4_linear(x, w, None, offsets, recipe)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    start, parts = 0, []
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            parts.append(fp4_linear(x[start:end], w[g], None, recipe))
        start = end
    want = torch.cat(parts)
    want.backward(grad)
    assert out.dtype == want.dtype == torch.bfloat16 and not bad
    assert torch.equal(out, want)
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad)


def _ref_experts(m, hidden, idx, weights, gate_up, down, gate_up_bias=None, down_bias=None):
    """transformers' eager experts loop with every expert GEMM replaced by its FP4 reference; each token's expert
    output weighted by the router weight of the slot that chose that expert."""
    out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32)
    per_slot = torch.zeros(idx.shape[0], idx.shape[1], hidden.shape[1])
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(idx == e)
        if token.numel() == 0:
            continue
        order = torch.argsort(token * idx.shape[1] + slot)  # the grouped forward's order within an expert
        token, slot = token[order], slot[order]
        h = _ref_linear(hidden[token], gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
        h = m._apply_gate(h)
        y = _ref_linear(h, down[e], None if down_bias is None else down_bias[e])
        per_slot[token, slot] = y * weights[token, slot, None]
    out = per_slot.sum(dim=1)
    return out


def _qwen3_experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=3)
    cfg._experts_implementation = "eager"
    m = Qwen3MoeExperts(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return m


def _gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=6, num_experts_per_tok=3)
    cfg._experts_implementation = "eager"
    m = GptOssExperts(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return m


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_interface_experts_forward_is_the_per_expert_reference_with_each_slots_weight(
        family: str, fp32_operands) -> None:  # noqa: F811
    from ds_nvfp4.nn.experts import FP4Experts
    from ds_nvfp4.nn.moe import find_moe

    torch.manual_seed(1)
    m = _qwen3_experts() if family == "qwen3_moe" else _gpt_oss_experts()
    holder = torch.nn.Module()
    holder.experts, holder.router = m, torch.nn.Linear(64, 6, bias=False)  # a router beside the experts
    site = find_moe(holder).site_of("experts")
    assert site is not None and site.execution == "interface" and site.router == "router"
    bf16 = copy.deepcopy(m)
    FP4Experts.convert(m, Recipe(weight_block=BLOCK), site)
    m.train()
    t, k = 24, 3
    hidden = torch.randn(t, 64)
    logits = torch.randn(t, 6)
    w, idx = logits.softmax(-1).topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)  # distinct weights per slot: a slot mix-up changes the output
    got = m(hidden, idx, w)
    if family == "gpt_oss":  # stored [E, K, N]: the GEMM's [N, K] is the transpose; biases per expert
        ref = _ref_experts(m, hidden, idx, w, m.gate_up_proj.detach().transpose(1, 2),
                           m.down_proj.detach().transpose(1, 2), m.gate_up_proj_bias.detach(),
                           m.down_proj_bias.detach())
    else:
        ref = _ref_experts(m, hidden, idx, w, m.gate_up_proj.detach(), m.down_proj.detach())
    assert torch.equal(got, ref.to(got.dtype))
    # near the module's own FP32 forward: NVFP4's error through two GEMMs and the gate (Gaussian operands:
    # ~10% relative error per quantized GEMM, ~25% through both; a slot or expert mix-up gives ~100%)
    own = bf16(hidden, idx, w)
    assert (got - own).norm() < 0.35 * own.norm()
    # each expert's running input amax is the max over its own tokens only
    for e in range(6):
        mine = hidden[(idx == e).any(-1)]
        want = mine.abs().max() if mine.numel() else torch.tensor(0.0)
        assert torch.equal(m.input_amax["gate_up_proj"][e], want.float())
    got.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def _intercepted(family: str):
    import tests.integrations.moe_families as fams

    model = fams.build(family)
    return model


@pytest.mark.parametrize("family", ["llama4_text", "dbrx"])
def test_intercepted_experts_run_each_expert_gemm_fp4_as_the_reference(family: str, fp32_operands) -> None:  # noqa: F811
    """Llama 4 (all experts in one bmm, [E, K, N]) and DBRX (2-D stacked experts, per-expert matmul with w1.T and
    w2 as stored): their own forward, every expert GEMM replaced by the FP4 GEMM of that expert's matrix."""
    from ds_nvfp4.nn.intercept import FP4InterceptedExperts

    model = _intercepted(family)
    model.train()
    ref = copy.deepcopy(model)
    convert_model(model, {"enabled": True, "modules": {"include": ["*experts*"]}})
    sites = [(n, m) for n, m in model.named_modules() if isinstance(m, FP4InterceptedExperts)]
    assert sites
    name, m = sites[0]
    r = ref.get_submodule(name)
    # feed both the same input through the experts module alone
    torch.manual_seed(3)
    t = 10
    hidden = torch.randn(t * (4 if family == "llama4_text" else 1), 64)
    def run():
        return m(hidden) if family == "llama4_text" else m(hidden, idx, w)

    if family == "llama4_text":
        got = m(hidden)
        h = hidden.view(4, t, 64)
        gate_up = torch.stack([_ref_linear(h[e], r.gate_up_proj[e].detach().t()) for e in range(4)])
        gate, up = gate_up.chunk(2, dim=-1)
        want = torch.stack([_ref_linear((up * r.act_fn(gate))[e], r.down_proj[e].detach().t())
                            for e in range(4)]).view(-1, 64)
    else:
        idx = torch.stack([torch.randperm(4)[:2] for _ in range(t)])
        w = torch.rand(t, 2)
        got = m(hidden, idx, w)
        split = (-1, 32, 64)
        want = torch.zeros(t, 64)
        for e in range(4):
            slot_tok = torch.where(idx == e)
            if slot_tok[0].numel() == 0:
                continue
            token, slot = slot_tok
            x = hidden[token]
            w1, v1 = r.mlp.w1.view(split)[e].detach(), r.mlp.v1.view(split)[e].detach()
            w2 = r.mlp.w2.view(split)[e].detach()
            h = r.mlp.activation_fn(_ref_linear(x, w1)) * _ref_linear(x, v1)
            want.index_add_(0, token, _ref_linear(h, w2.t()) * w[token, slot, None])
    got = got.reshape(want.shape).float()
    assert torch.equal(got, want), (got - want).abs().max()
    # with the weight cache on (ZeRO-0/1/2): the second forward reuses each expert's own codes
    for codes in m.experts_codes.values():
        codes.cache = True
    for _ in range(2):
        assert torch.equal(run().reshape(want.shape).float(), want)
    assert m.intercept is not None and not m.intercept["bf16"] and not m.intercept["unused"], m.intercept
