"""convert_model: decisions, reasons, counts, and the report formats."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ds_nvfp4
from ds_nvfp4.nn import NVFP4Linear
from tests.nn.models import TinyLM


def decisions(report) -> dict[str, tuple[bool, str]]:
    return {d.name: (d.fp4, d.reason) for d in report.layers}


def test_default_conversion_and_reasons() -> None:
    m = TinyLM()
    rep = ds_nvfp4.convert_model(m, {"enabled": True})
    d = decisions(rep)
    assert d["blocks.0.fc1"] == (True, "converted") and d["blocks.3.fc2"] == (True, "converted")
    assert not d["lm_head"][0] and "tied" in d["lm_head"][1] and "embed.weight" in d["lm_head"][1]
    assert not d["blocks.0.attn.out_proj"][0] and "MultiheadAttention" in d["blocks.0.attn.out_proj"][1]
    assert d["odd"] == (False, "out_features=10 is not a multiple of 16 (16x16 weight tiles)")
    assert isinstance(m.blocks[0].fc1, NVFP4Linear) and type(m.lm_head) is nn.Linear
    assert rep.blocks == "blocks (4 x Block)"
    fp4 = sum(m.blocks[i].fc1.weight.numel() + m.blocks[i].fc2.weight.numel() for i in range(4))
    assert rep.fp4_params == fp4 and rep.fp4_params + rep.bf16_params == sum(p.numel() for p in m.parameters())


def test_untied_lm_head_is_excluded_by_default_pattern() -> None:
    m = TinyLM(tie=False)
    d = decisions(ds_nvfp4.convert_model(m, {"enabled": True}))
    assert d["lm_head"] == (False, "excluded by modules.exclude pattern 'lm_head'")


def test_an_lm_head_that_escapes_the_filter_is_reported() -> None:
    """torchtitan #4008: a bad filter silently quantized the LM head. Here it is at least said, loudly."""
    m = TinyLM(tie=False)
    rep = ds_nvfp4.convert_model(m, {"enabled": True, "modules": {"exclude": []}})
    fp4, reason = decisions(rep)["lm_head"]
    assert fp4 and "vocabulary of 'embed'" in reason
    assert any("lm_head looks like an LM head" in n for n in rep.notes)
    assert "lm_head looks like an LM head" in rep.table()


def test_keep_first_and_last_blocks() -> None:
    m = TinyLM(layers=5)
    d = decisions(ds_nvfp4.convert_model(m, {"modules": {"keep_first_blocks_bf16": 2, "keep_last_blocks_bf16": 1}}))
    assert d["blocks.1.fc2"] == (False, "in block 1 of 5 (keep_first_blocks_bf16=2)")
    assert d["blocks.4.fc1"] == (False, "in block 4 of 5 (keep_last_blocks_bf16=1)")
    assert d["blocks.2.fc1"][0] and d["blocks.3.fc2"][0]


def test_keep_blocks_without_blocks_is_an_error() -> None:
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    with pytest.raises(ValueError, match="no repeated transformer blocks"):
        ds_nvfp4.convert_model(m, {"modules": {"keep_first_blocks_bf16": 1}})
    rep = ds_nvfp4.convert_model(m, {})
    assert "no repeated transformer blocks found" in rep.notes[0] and rep.blocks is None


def test_include_exclude_patterns() -> None:
    m = TinyLM(tie=False)
    d = decisions(ds_nvfp4.convert_model(m, {"modules": {"include": ["*fc1"], "exclude": ["blocks.2.*"]}}))
    assert d["blocks.0.fc1"][0] and not d["blocks.0.fc2"][0]
    assert "not matched by modules.include" in d["blocks.0.fc2"][1]
    assert d["blocks.2.fc1"] == (False, "excluded by modules.exclude pattern 'blocks.2.*'")


def test_in_features_rule() -> None:
    m = nn.Sequential(nn.Linear(24, 32))
    d = decisions(ds_nvfp4.convert_model(m, {}))
    assert d["0"] == (False, "in_features=24 is not a multiple of 16 (NVFP4 blocks run along K)")


def test_report_json_and_table() -> None:
    rep = ds_nvfp4.convert_model(TinyLM(), {"enabled": True})
    j = json.loads(rep.to_json())
    assert j["kernel"] == "emulated" and 0 < j["fp4_fraction"] < 1
    assert {layer["name"] for layer in j["layers"]} >= {"lm_head", "blocks.0.fc1"}
    table = rep.table()
    from ds_nvfp4.kernels import operand_choice

    # the backend, why, and the emulation's GEMM operand dtype for this CPU (kernels/operand.py)
    want = f"kernel emulated (no CUDA device: CPU; {operand_choice('cpu').describe()})"
    assert want in table and "blocks.0.fc1" in table
    assert "8 of 14 GEMM weights in NVFP4 (8 Linear)" in table


def test_converted_model_runs_and_matches_state_dict() -> None:
    torch.manual_seed(0)
    a, b = TinyLM(), TinyLM()
    b.load_state_dict(a.state_dict())
    ds_nvfp4.convert_model(b, {})
    assert a.state_dict().keys() == b.state_dict().keys()
    idx = torch.randint(0, 64, (2, 19))
    out_a, out_b = a(idx), b(idx)
    assert out_b.shape == out_a.shape
    rel = (out_a - out_b).norm() / out_a.norm()
    assert 0 < rel < 0.2  # FP4 is really on (not bit-identical to BF16) and close


class _Attn(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))


class _Llamaish(nn.Module):
    """Two blocks with q/k/v/o and gate/up/down names (what vLLM fuses), the second with an excluded v_proj."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attn(d) for _ in range(2))
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, 64), nn.Linear(d, 64), nn.Linear(64, d)


def test_fused_groups_share_one_weight_amax_in_the_forward() -> None:
    torch.manual_seed(0)
    m = _Llamaish()
    with torch.no_grad():
        m.layers[0].k_proj.weight.mul_(8.0)  # the group's largest |W|: q and v must quantize with it
    rep = ds_nvfp4.convert_model(m, {"enabled": True, "modules": {"exclude": ["layers.1.v_proj"]}})
    assert rep.fused_groups == [["gate_proj", "up_proj"], ["layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj"]]
    assert any("layers.1.q_proj, layers.1.k_proj, layers.1.v_proj mixes NVFP4 and BF16" in n for n in rep.notes)
    assert m.layers[1].q_proj.weight_codes.group is None
    assert "2 fused groups" in rep.table()
    q, k = m.layers[0].q_proj, m.layers[0].k_proj
    assert torch.equal(q.weight_codes.amax(), k.weight.abs().max())
    x = torch.randn(4, 32)
    from ds_nvfp4.nn.ops import fp4_linear

    shared = fp4_linear(x, q.weight, None, q.recipe, k.weight.abs().max())
    own = fp4_linear(x, q.weight, None, q.recipe, q.weight.abs().max())
    assert torch.equal(q(x), shared) and not torch.equal(shared, own)
    # the running input amax a W4A4 export needs: training forwards only
    q.eval()
    q(x * 100)
    assert q.input_amax == x.abs().max()
    rep_off = ds_nvfp4.convert_model(_Llamaish(), {"enabled": True, "modules": {"fuse": []}})
    assert rep_off.fused_groups == []
