"""The engine lifecycle (engine/lifecycle.py): what its features are told around a checkpoint load, and every
feature driven by DeepSpeed's step counter on 2 real ranks (unmanaged gradient accumulation)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ds_nvfp4.engine.lifecycle import Feature, Lifecycle, LoadContext
from tests.ranks import run_ranks
from tests.zero.engines import batch, config, make_engine


class _Recorder(Feature):
    name = "recorder"

    def __init__(self) -> None:
        self.loads: list[LoadContext] = []

    def after_load(self, state, load: LoadContext) -> None:
        self.loads.append(load)


def test_a_load_without_a_tag_tells_the_features_the_tag_latest_names(tmp_path: Path) -> None:
    """``engine.load_checkpoint(dir)`` (no tag, as launch/train.py --resume calls it): DeepSpeed loads the tag
    ``latest`` names, and the features must look for their state (RNG, spike guard, lr_decay) in that tag's folder,
    not in a folder called "None"."""
    (tmp_path / "latest").write_text("step300\n")
    rec = _Recorder()
    life = Lifecycle(engine=None, state=None, features=[rec])

    def deepspeed_load(load_dir, tag, *args, **kwargs):  # what DeepSpeed returns after loading something
        return f"{load_dir}/step300", {"step": 300}

    out = life.run_load(deepspeed_load, tmp_path, None)
    assert out[1] == {"step": 300}
    assert rec.loads == [LoadContext(str(tmp_path), "step300")]
    life.run_load(deepspeed_load, tmp_path, "step100")
    assert rec.loads[-1].tag == "step100"


def test_nothing_loaded_tells_the_features_nothing(tmp_path: Path) -> None:
    rec = _Recorder()
    Lifecycle(engine=None, state=None, features=[rec]).run_load(lambda d, t: (None, None), tmp_path, None)
    assert rec.loads == []



# -- on real ranks ------------------------------------------------------------------------------------------


def _unmanaged_engine(p: dict, cache: str, **over):
    os.environ["DS_NVFP4_WEIGHT_CACHE"] = cache
    cfg = config(preset=p["preset"], gas=2, managed_gradient_accumulation=False, **over)
    return make_engine(cfg)


def _unmanaged_train(engine, steps: range, rank: int, poison_at: int | None = None) -> list[float]:
    """``managed_gradient_accumulation: false``: the caller owns the boundary, two backwards then one step()."""
    if poison_at is not None:
        def poison(module, args):
            if module.training and engine.global_steps + 1 == poison_at and rank == 1:
                return (args[0] * float("nan"),)
            return None

        engine.module.get_submodule("blocks.1.fc1").register_forward_pre_hook(poison)
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(2):
            idx, tgt = batch(step * 10 + micro, rank)
            loss = engine(idx, tgt)
            engine.backward(loss)
            total += float(loss.detach()) / 2
        engine.step()
        losses.append(total)
    return losses


def scenario_unmanaged(rank: int, p: dict) -> dict:
    """Every feature with ``managed_gradient_accumulation: false`` (DeepSpeed's boundary probe is False outside
    step()): weight cache on and off give the same losses; the schedule changes phase at its steps; the monitor gets
    the statistics; a NaN raises NonFiniteError at its step on every rank."""
    import ds_nvfp4

    out: dict = {}
    for cache in ("1", "0"):
        engine = _unmanaged_engine(p, cache)
        out[f"losses_cache{cache}"] = _unmanaged_train(engine, range(4), rank)
        out[f"quantizations_cache{cache}"] = engine.module.blocks[1].fc1.weight_quantizations
    engine = _unmanaged_engine(p, "1", **{"precision.schedule": {"bf16_warmup_steps": 1, "bf16_from": 4},
                                          "precision.monitor": {"enabled": True, "interval": 1},
                                          "csv_monitor": {"enabled": True, "output_path": p["dir"],
                                                          "job_name": "job"}})
    phases = []
    for step in range(4):
        phases.append(engine.ds_nvfp4.schedule.current.name)
        _unmanaged_train(engine, range(step, step + 1), rank)
    out["phases"] = phases
    out["global_steps"] = engine.global_steps
    out["order"] = engine.ds_nvfp4.lifecycle.order
    engine = _unmanaged_engine(p, "1")
    try:
        _unmanaged_train(engine, range(5), rank, poison_at=3)
        out["error"] = None
    except ds_nvfp4.NonFiniteError as exc:
        out["error"], out["raised_at"] = str(exc), engine.global_steps
    return out


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["nvfp4_zero2.json", "nvfp4_zero3.json"])
def test_every_feature_with_unmanaged_gradient_accumulation(tmp_path, preset: str) -> None:
    """``managed_gradient_accumulation: false``: DeepSpeed's boundary probe is False outside step(), so features
    that asked it never ran (the weight cache kept step 1's codes, no NaN was reported, the schedule stood still).
    The lifecycle reads DeepSpeed's step counter instead."""
    for r in run_ranks(scenario_unmanaged, preset=preset, dir=str(tmp_path)):
        assert r["losses_cache1"] == r["losses_cache0"], (r["losses_cache1"], r["losses_cache0"])
        if preset == "nvfp4_zero2.json":  # ZeRO-0/1/2: once per optimizer step; without the cache once per forward
            # (block 1 is activation-checkpointed: 4 steps x 2 micro-batches x (forward + recomputation))
            assert r["quantizations_cache1"] == 4 and r["quantizations_cache0"] == 16
        assert r["phases"] == ["warmup", "fp4", "fp4", "late"] and r["global_steps"] == 4
        assert r["order"] == ["checkpoint", "weight_cache", "nonfinite", "statistics", "schedule"]
        assert r["error"] is not None and r["raised_at"] == 3 and "step 3" in r["error"], r.get("error")
    rows = (tmp_path / "job" / "Train_Precision_blocks.1.fc1_input_rel_error.csv").read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in rows] == [2, 3]  # every step with an FP4 forward (interval 1)

