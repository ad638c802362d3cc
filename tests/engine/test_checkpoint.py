"""The checkpoint feature (engine/checkpoint.py) on 2 real ranks: a resume repeats the run bit for bit, `latest`
moves last, DeepSpeed's own readers still read the checkpoint."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.ranks import run_ranks
from tests.zero.engines import (
    config,
    digests,
    exactness,
    make_engine,
    train,
)


def scenario_checkpoint(rank: int, p: dict) -> dict:
    """Train 6 steps saving at 3; a fresh engine loads step 3 and trains 4..6: losses must match exactly. Records
    when each file of the save was renamed into place (``os.replace``, wall clock in ns) on this rank."""
    import time

    import deepspeed

    cfg = config(**p.get("config", {}))
    ckpt = p["dir"]
    e1 = make_engine(copy.deepcopy(cfg))
    first = train(e1, range(3), rank)
    w3 = {n: float(deepspeed.utils.safe_get_full_fp32_param(q).double().sum()) for n, q in
          e1.module.named_parameters()}
    d3 = digests(e1)
    renamed, real_replace = [], os.replace

    def replace(src, dst, *a, **kw):
        out = real_replace(src, dst, *a, **kw)
        renamed.append((time.time_ns(), os.path.basename(str(dst))))
        return out

    os.replace = replace
    e1.save_checkpoint(ckpt, tag="step3")
    os.replace = real_replace
    rest = train(e1, range(3, 6), rank)
    w_ref = {n: float(deepspeed.utils.safe_get_full_fp32_param(q).double().sum()) for n, q in
             e1.module.named_parameters()}
    d_ref = digests(e1)
    e1.save_16bit_model(ckpt, "model16.bin")
    e2 = make_engine(copy.deepcopy(cfg), seed=123)  # different init: everything must come from the checkpoint
    e2.load_checkpoint(ckpt, tag="step3")
    resumed = train(e2, range(3, 6), rank)
    w_res = {n: float(deepspeed.utils.safe_get_full_fp32_param(q).double().sum()) for n, q in
             e2.module.named_parameters()}
    return {"first": first, "rest": rest, "resumed": resumed, "w_ref": w_ref, "w_res": w_res, "w3": w3,
            "d3": d3, "d_ref": d_ref, "d_res": digests(e2), "renamed": renamed,
            "exact_after_resume": exactness(e2)}


@pytest.mark.slow
def test_checkpoint_resume_is_exact(tmp_path) -> None:
    res = run_ranks(scenario_checkpoint, dir=str(tmp_path / "ckpt"),
                    config={"zero_optimization.stage3_gather_16bit_weights_on_model_save": True})
    for r in res:
        assert r["resumed"] == r["rest"], (r["rest"], r["resumed"])
        assert r["d_res"] == r["d_ref"]  # every FP32 master, bit for bit (sha256 of the full tensor)
        assert all(v["equal"] for v in r["exact_after_resume"].values() if v["packed"])
    # every rank's RNG state is in place before `latest` names the checkpoint (a crash between them must leave
    # `latest` on the previous checkpoint, not on one without the state that makes resume bit-exact)
    rng = [t for r in res for t, name in r["renamed"] if name.startswith("ds_nvfp4_rng_rank")]
    (latest,) = [t for r in res for t, name in r["renamed"] if name == "latest"]
    assert len(rng) == len(res) and max(rng) < latest
    (meta,) = [t for r in res for t, name in r["renamed"] if name == "ds_nvfp4.json"]
    assert meta < latest
    # zero_to_fp32 reads the checkpoint unchanged (trainable low-precision partitions are never saved)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="step3")
    d3 = res[0]["d3"]
    assert set(sd) == set(d3)
    for k, v in sd.items():
        assert _digest(v) == d3[k], k
    # save_16bit_model writes the BF16 weights the forward sees
    model16 = torch.load(tmp_path / "ckpt" / "model16.bin", weights_only=True)
    assert model16["blocks.0.fc1.weight"].dtype == torch.bfloat16 and model16["blocks.0.fc1.weight"].shape == (256, 64)


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()

