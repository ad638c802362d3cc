"""Unmodified Hugging Face Trainer and Accelerate scripts train NVFP4 under ZeRO-3 on 2 real CPU ranks.

Nothing in the scripts mentions ds_nvfp4: the start-up hook (``ds_nvfp4_autohook.pth``) routes their
``deepspeed.initialize`` to ``ds_nvfp4.initialize`` because the ds_config has a ``precision`` section. Real
launchers (``deepspeed --num_gpus 2``, ``accelerate launch``), real transformers/accelerate, no downloads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.integrations.hf_run import BIN, HERE, HF_DS_CONFIG, launch
from tests.ranks import free_port

pytestmark = pytest.mark.slow


def check_nvfp4_run(out: Path, log: str) -> list[dict]:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["has_state"], f"rank {r['rank']}: the precision section was ignored (plain BF16 engine)"
        rep = r["report"]
        assert rep["packed_params"] == 28, rep  # 4 layers x 7 projections
        assert 0.25 < rep["ratio"] < 0.26, rep
        layers = {d["name"]: d for d in r["conversion"]["layers"]}
        assert not layers["lm_head"]["fp4"] and "excluded" in layers["lm_head"]["reason"]
        assert len(r["conversion"]["fused_groups"]) == 8  # q/k/v and gate/up in each of 4 layers
        losses = r["losses"]
        assert len(losses) == 6 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5, losses
    # the one-line summary, printed once (rank 0), with no logging set up by the script
    on = "ds_nvfp4: NVFP4 training ON: 28 GEMM weights NVFP4 (28 Linear), 1 kept BF16 (lm_head)"
    assert log.count(on) == 1, log[-4000:]
    assert "ZeRO-3 weights packed" in log
    return ranks


def test_hf_trainer_script_trains_nvfp4_unmodified(hf_trainer_run: Path) -> None:
    ranks = check_nvfp4_run(hf_trainer_run, (hf_trainer_run.parent / "log.txt").read_text())
    assert all(r["built_under_zero_init"] for r in ranks), "from_pretrained did not build under zero.Init"
    ckpt = hf_trainer_run / "checkpoint-6"
    assert (ckpt / "config.json").exists() and (ckpt / "latest").read_text().strip() == "global_step6"
    meta = json.loads((ckpt / "global_step6" / "ds_nvfp4.json").read_text())
    # running input amaxes of every NVFP4 layer, agreed over ranks, for a W4A4 export
    assert len(meta["input_amax"]) == 28 and all(v is not None and v > 0 for v in meta["input_amax"].values())
    assert meta["packed"] is True


def test_accelerate_launch_with_deepspeed_plugin_trains_nvfp4(tmp_path: Path) -> None:
    cfg = {**HF_DS_CONFIG, "bf16": {"enabled": True}, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    del cfg["optimizer"], cfg["train_batch_size"]  # the script brings its own torch optimizer
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    (tmp_path / "acc.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        f"  deepspeed_config_file: {tmp_path / 'ds.json'}\n  zero3_init_flag: true\nmachine_rank: 0\n"
        f"num_machines: 1\nnum_processes: 2\nuse_cpu: true\nmain_process_port: {free_port()}\n")
    out = tmp_path / "out"
    out.mkdir()
    log = launch([str(BIN / "accelerate"), "launch", "--config_file", str(tmp_path / "acc.yaml"),
                  str(HERE / "accelerate_script.py"), "--out", str(out)], tmp_path / "log.txt")
    check_nvfp4_run(out, log)
