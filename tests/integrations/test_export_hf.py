"""`ds-nvfp4 export` of an HF Trainer checkpoint-N folder: HF model folders that transformers loads, with the
bits the training forward saw, meeting every vLLM/TensorRT-LLM loader requirement (serving_requirements.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integrations.serving_requirements import REQUIREMENTS, Export, check_export
from tests.reference import VALUES

pytestmark = pytest.mark.slow
FORMATS = [("nvfp4-compressed-tensors", []), ("nvfp4-compressed-tensors", ["--weight-only"]),
           ("nvfp4-modelopt", []), ("nvfp4-modelopt", ["--weight-only"])]


def export(ckpt: Path, out: Path, fmt: str, *extra: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "export", str(ckpt), str(out), "--format", fmt, *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def run(hf_trainer_run: Path) -> dict:
    ckpt = hf_trainer_run / "checkpoint-6"
    meta = json.loads((ckpt / "global_step6" / "ds_nvfp4.json").read_text())
    layers = meta["conversion"]["layers"]
    return {"ckpt": ckpt, "seen": torch.load(hf_trainer_run / "forward_weights.pt"),
            "nvfp4": [d["name"] for d in layers if d["fp4"]], "bf16": [d["name"] for d in layers if not d["fp4"]
                                                                   and d["kind"] in ("Linear", "Conv1D", "router")],
            "fused": meta["conversion"]["fused_groups"]}


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 values of packed codes (element 2i in the low nibble)."""
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    return VALUES[codes.long()]


@pytest.mark.parametrize(("fmt", "extra"), FORMATS)
def test_export_meets_every_serving_requirement(run: dict, tmp_path: Path, fmt: str, extra: list) -> None:
    r = export(run["ckpt"], tmp_path, fmt, *extra)
    scheme = "W4A16" if extra else "W4A4"
    assert f"{scheme}:" in r.stdout and "8 fused groups" in r.stdout, r.stdout
    e = Export.open(tmp_path, fmt, scheme, run["nvfp4"], run["bf16"], run["fused"])
    assert check_export(e) == []
    assert sum(fmt in q.formats for q in REQUIREMENTS) >= 6
    assert e.config["architectures"] == ["LlamaForCausalLM"] and (tmp_path / "generation_config.json").exists()
    # the codes are the training forward's: dequantized the way the consumer does, they equal its weights
    for name in run["nvfp4"]:
        t = e.tensors
        if fmt == "nvfp4-modelopt":
            w = _unpack(t[f"{name}.weight"]) * t[f"{name}.weight_scale"].float().repeat_interleave(16, 1)
            w = w * t[f"{name}.weight_scale_2"]
        else:
            w = _unpack(t[f"{name}.weight_packed"]) * t[f"{name}.weight_scale"].float().repeat_interleave(16, 1)
            w = w / t[f"{name}.weight_global_scale"]
        assert torch.equal(w.to(torch.bfloat16), run["seen"][name]), name


def test_bf16_and_compressed_tensors_exports_load_in_transformers_with_the_same_logits(run: dict,
                                                                                       tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    export(run["ckpt"], tmp_path / "bf16", "bf16")
    export(run["ckpt"], tmp_path / "ct", "nvfp4-compressed-tensors", "--weight-only")
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    ct = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16)
    sd = bf16.state_dict()
    for name in run["nvfp4"]:  # the weights the training forward multiplied, bit for bit
        assert torch.equal(sd[f"{name}.weight"], run["seen"][name]), name
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = bf16(ids).logits, ct(ids).logits
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), (a - b).abs().max()


def test_lora_trains_on_the_export_of_this_training(run: dict, tmp_path: Path) -> None:
    """The round trip of docs/finetune.md: NVFP4 training, `ds-nvfp4 export` in the ModelOpt layout (the
    compressed-tensors one: tests/integrations/test_hf_lora.py and the cluster test), then LoRA on that folder
    under the unmodified PEFT + HF Trainer script on 2 ranks: every exported NVFP4 layer is a frozen base packed from
    the folder's codes, the adapters lower the loss."""
    from tests.integrations.hf_run import BIN, HERE, launch, lora_ds_config
    from tests.ranks import free_port

    export(run["ckpt"], tmp_path / "model", "nvfp4-modelopt", "--weight-only")
    (tmp_path / "ds.json").write_text(json.dumps(lora_ds_config(tmp_path / "model")))
    out = tmp_path / "lora"
    out.mkdir()
    launch([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
            str(HERE / "hf_lora_script.py"), "--deepspeed", str(tmp_path / "ds.json"), "--base",
            str(tmp_path / "model"), "--out", str(out), "--steps", "4", "--save_steps", "4"], tmp_path / "log.txt")
    for k in range(2):
        r = json.loads((out / f"rank{k}.json").read_text())
        assert r["report"]["frozen_params"] == len(run["nvfp4"]), r["report"]
        assert r["losses"]["4"] < r["losses"]["1"], r["losses"]
