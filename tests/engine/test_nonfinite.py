"""The nonfinite feature (engine/nonfinite.py) on 2 real ranks: raise on every rank, or skip, count and bound."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import run_ranks
from tests.zero.engines import (
    batch,
    config,
    make_engine,
)


def scenario_nonfinite(rank: int, p: dict) -> dict:
    """NaN injected into ``blocks.1.fc1``'s input on rank 1 only, at the given steps (1-based).

    Records where ``NonFiniteError`` was raised (every rank must raise: no hang), whether the FP32 masters are
    those of the last good step, and the skipped-step count.
    """
    import deepspeed

    import ds_nvfp4

    cfg = config(preset=p.get("preset", "nvfp4_zero3.json"), **p.get("config", {}))
    engine = make_engine(cfg)
    bad = set(p["bad_steps"])

    def poison(module, args):  # block 1 is activation-checkpointed: its recomputation is poisoned too
        if module.training and engine.global_steps + 1 in bad and rank == 1:
            return (args[0] * float("nan"),)
        return None

    engine.module.get_submodule("blocks.1.fc1").register_forward_pre_hook(poison)

    def masters() -> dict:
        return {n: deepspeed.utils.safe_get_full_fp32_param(q).clone() for n, q in engine.module.named_parameters()}

    out: dict = {"losses": [], "error": None, "raised_at": None, "unchanged_after_skip": []}
    prev = masters()
    for step in range(1, p.get("steps", 6) + 1):
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        try:
            engine.step()
        except ds_nvfp4.NonFiniteError as exc:
            now = masters()
            out.update(error=str(exc), raised_at=step, masters_unchanged=all(torch.equal(prev[n], now[n])
                                                                             for n in prev))
            break
        now = masters()
        if step in bad:
            out["unchanged_after_skip"].append(all(torch.equal(prev[n], now[n]) for n in prev))
        else:
            out["losses"].append(float(loss))
        prev = now
    out["skipped"] = engine.ds_nvfp4.skipped_steps
    out["all_masters_finite"] = all(bool(torch.isfinite(v).all()) for v in masters().values())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["nvfp4_zero3.json", "nvfp4_zero2.json"])
def test_nonfinite_gradients_raise_on_every_rank_with_the_step_and_the_layer(preset: str) -> None:
    ranks = run_ranks(scenario_nonfinite, preset=preset, bad_steps=[3])  # NaN on rank 1 only: rank 0 must stop too
    for r in ranks:
        assert r["raised_at"] == 3 and "step 3: gradients hold NaN/Inf" in r["error"], r
        assert r["masters_unchanged"] and r["all_masters_finite"] and len(r["losses"]) == 2
    assert "first FP4 layers with a non-finite input or output on this rank: blocks.1.fc1" in ranks[1]["error"]
    assert "no FP4 layer saw a non-finite" in ranks[0]["error"]


@pytest.mark.slow
def test_nonfinite_skip_is_counted_and_bounded() -> None:
    cfg = {"precision.nonfinite": {"action": "skip", "max_consecutive_skips": 2}}
    for r in run_ranks(scenario_nonfinite, config=cfg, bad_steps=[2, 4, 5, 6]):
        assert r["unchanged_after_skip"] == [True, True, True] and r["all_masters_finite"]
        assert r["raised_at"] == 6 and "3 steps in a row were skipped, more than" in r["error"], r
        assert r["skipped"] == 4 and len(r["losses"]) == 2  # steps 1 and 3 trained

