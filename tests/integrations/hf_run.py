"""Launching the unmodified HF scripts on 2 CPU ranks with the real launchers (shared by the tests here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

from ds_nvfp4.zero.teardown import EXIT_ABORT
from tests.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TIMEOUT = 900

#: what HF Trainer / Accelerate users put in their ds_config: "auto" wherever the trainer fills it
HF_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto", "torch_adam": True}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "precision": {"enabled": True},
}


def lora_ds_config(checkpoint: Path) -> dict:
    """HF_DS_CONFIG for LoRA on the NVFP4 checkpoint ``checkpoint`` (docs/finetune.md): a frozen base read as stored
    (1x16 blocks, NVFP4 gathers); the 16-bit weights gathered when the Trainer saves (its adapters)."""
    ds = {k: v for k, v in HF_DS_CONFIG.items() if k != "train_batch_size"}
    ds["zero_optimization"] = {**ds["zero_optimization"], "stage3_gather_16bit_weights_on_model_save": True}
    ds["precision"] = {"enabled": True, "weights": {"block": "1x16"}, "communication": {"all_gather": "nvfp4"},
                       "base": {"frozen": True, "checkpoint": str(checkpoint)}}
    return ds


def env() -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    return {**keep, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}


def aborted_at_exit_only(returncode: int, text: str, what: str) -> bool:
    """Whether a launch that failed (``returncode``, its output ``text``) failed only by a rank's abort at
    interpreter exit after its work (zero/teardown.py: gloo's worker threads, pytorch/pytorch#190489), with no
    traceback before it; if so, say it with a warning naming ``what``. The caller checks every rank's results."""
    if returncode == 0 or EXIT_ABORT not in text or "Traceback" in text.split(EXIT_ABORT)[0]:
        return False
    warnings.warn(f"{what}: a rank aborted at interpreter exit after its work ({EXIT_ABORT})", stacklevel=3)
    return True


def launch(cmd: list[str], log: Path) -> str:
    """Run a launcher command to completion (bounded); its output goes to ``log``; fail with its tail.

    A rank's abort at interpreter exit, after its work and with no traceback, is let through with a warning; every
    caller then reads each rank's results, so a rank that died earlier still fails the test. The abort is torch's
    race (zero/teardown.py: a gloo worker that asks for the GIL once finalization began): ds_nvfp4's exit-time
    teardown narrows it, and 0 of 19 local launches of the LoRA script aborted
    (docs/evidence/teardown/hf_lora_loop.txt), yet one CI run saw it twice (the MoE families and the LoRA script;
    docs/integrations.md)."""
    with open(log, "w") as fh:
        r = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=fh, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    text = log.read_text()
    if aborted_at_exit_only(r.returncode, text, " ".join(cmd[:2])):
        return text
    assert r.returncode == 0, f"{' '.join(cmd[:3])} failed ({r.returncode}):\n{text[-6000:]}"
    return text


def run_hf_trainer(root: Path, families: list[str] | None = None) -> Path:
    """Save a tiny Llama (or each of ``families``: tests/integrations/families.py), fine-tune it with the unmodified
    Trainer script under ``deepspeed --num_gpus 2`` (from_pretrained builds it under zero.Init); returns the output
    folder (``checkpoint-6`` inside; ``<family>/checkpoint-6`` with families)."""
    import torch

    from tests.integrations.families import build
    from tests.integrations.hf_trainer_script import tiny_llama

    model_dir = root / "tiny-llama"
    torch.manual_seed(0)
    if families:
        for name in families:
            build(name).to(torch.bfloat16).save_pretrained(model_dir / name)
    else:
        tiny_llama().to(torch.bfloat16).save_pretrained(model_dir)
    # without train_batch_size: on CPU, HF's from_pretrained under zero.Init builds DeepSpeedConfig before the
    # world size is known and fails its batch assertion on the resolved value (plain DeepSpeed does it too)
    (root / "ds.json").write_text(json.dumps({k: v for k, v in HF_DS_CONFIG.items() if k != "train_batch_size"}))
    out = root / "out"
    out.mkdir()
    launch([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
            str(HERE / "hf_trainer_script.py"), "--deepspeed", str(root / "ds.json"), "--out", str(out),
            "--model_dir", str(model_dir), *(["--families", ",".join(families)] if families else [])], root / "log.txt")
    return out
