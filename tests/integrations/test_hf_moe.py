"""MoE experts and GPT-2 Conv1D under an unmodified HF Trainer (2 ranks, ZeRO-3 packed storage), and the exports of
an MoE run that transformers reads back with per-expert names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.integrations.hf_run import BIN, ROOT, run_hf_trainer
from tests.integrations.test_export_hf import _unpack

pytestmark = pytest.mark.slow

# Every family trains under plain DeepSpeed (tests/zero/test_zero3.py); under the Trainer one interface MoE, GPT-2's
# Conv1D and the three whose experts are not found by attribute names: GPT-OSS (biased, transposed, interleaved
# gate/up), DBRX (experts stacked in 2-D parameters) and Llama 4 (all experts in one bmm).
FAMILIES = ["qwen3_moe", "gpt2", "gpt_oss", "dbrx", "llama4_text"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return run_hf_trainer(tmp_path_factory.mktemp("hf_moe"), FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_expert_matrix_and_conv1d_is_nvfp4_under_the_trainer(runs: Path, family: str) -> None:
    ranks = [json.loads((runs / family / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["has_state"] and r["built_under_zero_init"], r
        layers = r["conversion"]["layers"]
        experts = [d for d in layers if d["kind"] == "experts"]
        conv = [d for d in layers if d["kind"] == "Conv1D"]
        if family == "gpt2":
            assert conv and all(d["fp4"] for d in conv) and not experts
        else:  # one row per expert tensor, every one NVFP4; routers BF16 with the reason
            assert experts and all(d["fp4"] and d["experts"] == 4 for d in experts), experts
            routers = [d for d in layers if d["kind"] == "router"]
            assert routers and all(not d["fp4"] and d["reason"].startswith("router of") for d in routers), routers
        rep = r["report"]
        assert rep["packed_params"] > 0 and not [n for n in rep["kept_bf16"] if "experts" in n], rep["kept_bf16"]
        assert all(math.isfinite(v) for v in r["losses"]) and len(r["losses"]) == 6


def _export(ckpt: Path, out: Path, fmt: str, *extra: str) -> str:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "export", str(ckpt), str(out), "--format", fmt, *extra],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_moe_exports_use_per_expert_names_and_the_bf16_one_loads_in_transformers(runs: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ckpt = runs / "qwen3_moe" / "checkpoint-6"
    _export(ckpt, tmp_path / "bf16", "bf16")
    said = _export(ckpt, tmp_path / "ct", "nvfp4-compressed-tensors", "--weight-only")
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight_packed" in keys
    assert "model.layers.0.mlp.experts.3.up_proj.weight_global_scale" in keys
    assert not any("gate_up_proj" in k for k in keys), "the fused in-memory name must not reach an export"
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        for e in range(4):  # gate and up of one expert: one global scale (vLLM's fused w13, TensorRT-LLM's assert)
            g = f.get_tensor(f"model.layers.1.mlp.experts.{e}.gate_proj.weight_global_scale")
            u = f.get_tensor(f"model.layers.1.mlp.experts.{e}.up_proj.weight_global_scale")
            assert torch.equal(g, u)
    ignore = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.mlp.gate" in ignore and "lm_head" in ignore, ignore
    assert "W4A16" in said and "per-expert names" in said, said
    # transformers reads the per-expert names back into its fused experts parameter, equal to what training multiplied
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    seen = torch.load(runs / "qwen3_moe" / "forward_weights.pt")
    for layer in range(3):
        key = f"model.layers.{layer}.mlp.experts"
        got = bf16.model.layers[layer].mlp.experts
        assert torch.equal(got.gate_up_proj, seen[f"{key}.gate_up_proj"]) and torch.equal(got.down_proj,
                                                                                           seen[f"{key}.down_proj"])
        # each expert's NVFP4 codes, dequantized the way a fused-MoE loader does, are that expert's training weights
        with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
            for e in range(4):
                parts = []
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    name = f"{key}.{e}.{proj}"
                    w = _unpack(f.get_tensor(f"{name}.weight_packed"))
                    w = w * f.get_tensor(f"{name}.weight_scale").float().repeat_interleave(16, 1)
                    parts.append((w / f.get_tensor(f"{name}.weight_global_scale")).to(torch.bfloat16))
                assert torch.equal(torch.cat(parts[:2]), got.gate_up_proj[e]), (key, e)
                assert torch.equal(parts[2], got.down_proj[e]), (key, e)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(bf16(ids).logits).all()
    assert BIN.exists()


@pytest.mark.parametrize("family", ["gpt_oss", "dbrx", "llama4_text", "gpt2"])
def test_bf16_exports_of_the_new_moe_families_load_in_transformers_with_the_trained_weights(
        runs: Path, tmp_path: Path, family: str) -> None:
    """transformers writes the BF16 export itself (save_pretrained of the model built from the checkpoint's config),
    so each family's own layout loads back: every weight equals what the training forward multiplied (GPT-2: its
    Conv1D weights in their stored [in, out] layout)."""
    from transformers import AutoModelForCausalLM

    _export(runs / family / "checkpoint-6", tmp_path / "bf16", "bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    seen = torch.load(runs / family / "forward_weights.pt")
    params = dict(model.named_parameters())
    got = {n: params[n] if n in params else params[f"{n}.weight"] for n in seen}  # Linears are named as modules
    assert seen and all(torch.equal(got[n], w) for n, w in seen.items()), \
        [n for n, w in seen.items() if not torch.equal(got[n], w)][:4]
    assert any(".experts." in n or ".c_attn" in n for n in seen)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_nvfp4_exports_name_gpt_oss_experts_per_expert_with_biases_and_refuse_undeclared_layouts(
        runs: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    said = _export(runs / "gpt_oss" / "checkpoint-6", tmp_path / "ct", "nvfp4-compressed-tensors", "--weight-only")
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        seen = torch.load(runs / "gpt_oss" / "forward_weights.pt")
        fused = seen["model.layers.1.mlp.experts.gate_up_proj"][2].t()  # expert 2, [2I, H]: gate/up interleaved
        for proj, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
            name = f"model.layers.1.mlp.experts.2.{proj}"
            w = _unpack(f.get_tensor(f"{name}.weight_packed"))
            w = w * f.get_tensor(f"{name}.weight_scale").float().repeat_interleave(16, 1)
            assert torch.equal((w / f.get_tensor(f"{name}.weight_global_scale")).to(torch.bfloat16), fused[rows])
            assert f"{name}.bias" in keys
    assert "model.layers.1.mlp.experts.2.down_proj.bias" in keys and not any("gate_up_proj" in k for k in keys)
    assert "per-expert names" in said
    for family in ("dbrx", "llama4_text"):
        import subprocess
        import sys

        r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "export", str(runs / family / "checkpoint-6"),
                            str(tmp_path / family), "--format", "nvfp4-modelopt"], capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
        assert r.returncode != 0 and "own forward" in r.stderr and not (tmp_path / family).exists(), r.stderr


def test_moe_export_is_w4a4_with_each_experts_own_recorded_input_amax(runs: Path, tmp_path: Path) -> None:
    """Training recorded each expert's input amax (``<module>.<parameter>.<expert>``): the NVFP4 export declares
    W4A4 and writes every expert projection's static input scale from its own expert's amax (gate and up share the
    gate_up input)."""
    from safetensors import safe_open

    ckpt = runs / "qwen3_moe" / "checkpoint-6"
    said = _export(ckpt, tmp_path / "ct", "nvfp4-compressed-tensors")
    meta = json.loads(next(ckpt.glob("global_step*/ds_nvfp4.json")).read_text())
    amax = meta["input_amax"]
    assert "W4A4" in said, said
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        for layer in range(3):
            key = f"model.layers.{layer}.mlp.experts"
            for e in range(4):
                for proj, param in (("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj"),
                                    ("down_proj", "down_proj")):
                    got = float(f.get_tensor(f"{key}.{e}.{proj}.input_global_scale"))
                    assert got == pytest.approx(2688.0 / amax[f"{key}.{param}.{e}"], rel=1e-6), (key, e, proj)


def test_lora_trains_on_the_moe_export_of_this_training(runs: Path, tmp_path: Path) -> None:
    """The MoE round trip of docs/finetune.md: the Qwen3-MoE run exported by `ds-nvfp4 export` (per-expert names),
    then LoRA on the attention under the unmodified PEFT + HF Trainer script on 2 ranks: the exported attention and
    every fused experts parameter are a frozen base packed from the folder's codes, the adapters lower the loss.
    ModelOpt's layout here; the compressed-tensors MoE layout is trained under the same script by
    tests/integrations/test_hf_lora.py::test_lora_on_a_moe_checkpoint_under_hf_trainer (one LoRA launch per layout
    keeps the suite's time)."""
    fmt = "nvfp4-modelopt"
    from ds_nvfp4.checkpoint.hf_nvfp4 import open_nvfp4_checkpoint
    from tests.integrations.hf_run import HERE, launch, lora_ds_config
    from tests.ranks import free_port

    _export(runs / "qwen3_moe" / "checkpoint-6", tmp_path / "model", fmt, "--weight-only")
    weights = open_nvfp4_checkpoint(tmp_path / "model").weights
    sites = {m.rsplit(".", 2)[0] for m in weights if ".experts." in m}
    frozen = len([m for m in weights if ".experts." not in m]) + 2 * len(sites)  # gate_up_proj and down_proj each
    assert sites, sorted(weights)
    (tmp_path / "ds.json").write_text(json.dumps(lora_ds_config(tmp_path / "model")))
    out = tmp_path / "lora"
    out.mkdir()
    launch([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
            str(HERE / "hf_lora_script.py"), "--deepspeed", str(tmp_path / "ds.json"), "--base",
            str(tmp_path / "model"), "--out", str(out), "--steps", "4", "--save_steps", "4",
            "--targets", "q_proj,k_proj,v_proj,o_proj"], tmp_path / "log.txt")
    for k in range(2):
        r = json.loads((out / f"rank{k}.json").read_text())
        assert r["report"]["frozen_params"] == frozen and "read as stored" in r["report"]["frozen_source"], r["report"]
        assert any(f"{frozen} weights to be packed from their stored codes" in n for n in r["notes"]), r["notes"]
        assert r["losses"]["4"] < r["losses"]["1"], r["losses"]
