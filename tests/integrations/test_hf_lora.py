"""PEFT LoRA on a published NVFP4 checkpoint under an unmodified HF Trainer script, ZeRO-3 on 2 real ranks
(``deepspeed --num_gpus 2 hf_lora_script.py --deepspeed ds.json``): the base packed from the checkpoint's codes,
adapters train, a resumed run continues with the same losses, adapters saved in PEFT's format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.tiny import llama_folder, moe_folder, tiny_qwen3_moe
from tests.integrations.hf_run import BIN, HERE, launch, lora_ds_config
from tests.ranks import free_port

pytestmark = pytest.mark.slow


def _run(root: Path, out: Path, *extra: str) -> list[dict]:
    launch([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
            str(HERE / "hf_lora_script.py"), "--deepspeed", str(root / "ds.json"), "--base", str(root / "ckpt"),
            "--out", str(out), *extra], out.with_suffix(".log"))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_lora_on_an_nvfp4_checkpoint_under_hf_trainer_resumes_exactly(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    llama_folder(tmp_path / "ckpt")
    (tmp_path / "ds.json").write_text(json.dumps(lora_ds_config(tmp_path / "ckpt")))
    first = _run(tmp_path, tmp_path / "a")
    for r in first:
        assert r["report"]["frozen_params"] == 14 and "read as stored" in r["report"]["frozen_source"], r
    losses = first[0]["losses"]
    assert len(losses) == 6 and losses["6"] < losses["1"], losses
    resumed = _run(tmp_path, tmp_path / "b", "--resume", str(tmp_path / "a" / "checkpoint-3"))
    # the resumed log history holds steps 1-3 from checkpoint-3's trainer state
    assert resumed[0]["losses"] == losses, (resumed[0]["losses"], losses)
    adapter = tmp_path / "a" / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert len([k for k in tensors if "lora_B" in k]) == 14 and all(t.abs().sum() > 0 for t in tensors.values())
    # the DeepSpeed checkpoint holds no base weights: export says what to do instead; merge writes the model
    r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "export", str(tmp_path / "a" / "checkpoint-6"),
                        str(tmp_path / "x"), "--format", "bf16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "ds-nvfp4 merge BASE ADAPTER OUT" in r.stderr and not (tmp_path / "x").exists()
    r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "merge", str(tmp_path / "ckpt"), str(adapter),
                        str(tmp_path / "merged"), "--format", "bf16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged") is not None


def test_lora_on_a_moe_checkpoint_under_hf_trainer(tmp_path: Path) -> None:
    """A Qwen3-MoE checkpoint with per-expert names: the fused experts packed from the per-expert codes beside the
    attention, attention adapters train under HF Trainer, resume exactly, and merge into a folder transformers
    loads."""
    moe_folder(tmp_path / "ckpt", tiny_qwen3_moe(0))
    (tmp_path / "ds.json").write_text(json.dumps(lora_ds_config(tmp_path / "ckpt")))
    attention = ("--targets", "q_proj,k_proj,v_proj,o_proj")
    first = _run(tmp_path, tmp_path / "a", *attention)
    for r in first:  # 8 attention weights and 4 fused experts weights
        assert r["report"]["frozen_params"] == 12 and "read as stored" in r["report"]["frozen_source"], r
        assert any("12 weights to be packed from their stored codes" in n for n in r["notes"]), r["notes"]
    losses = first[0]["losses"]
    assert len(losses) == 6 and losses["6"] < losses["1"], losses
    resumed = _run(tmp_path, tmp_path / "b", *attention, "--resume", str(tmp_path / "a" / "checkpoint-3"))
    assert resumed[0]["losses"] == losses, (resumed[0]["losses"], losses)
    r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "merge", str(tmp_path / "ckpt"), str(tmp_path / "a" /
                        "adapter"), str(tmp_path / "merged"), "--format", "bf16"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "merged 8 LoRA-adapted layers" in r.stdout, r.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged") is not None
