"""The weight_cache feature (engine/weight_cache.py): one quantization per weight version under ZeRO-0/1/2."""

from __future__ import annotations

import os

import pytest
import torch

from ds_nvfp4.envcheck import allocator_note
from tests.ranks import run_ranks
from tests.zero.engines import (
    batch,
    config,
    make_engine,
    train,
)


def scenario_weight_cache(rank: int, p: dict) -> dict:
    """ZeRO-2, gradient accumulation 2, block 1 activation-checkpointed, an evaluation forward after the last step:
    per FP4 layer, how many times its weight was quantized, and the losses (cache on or off: same codes). With
    ``dir``: a checkpoint saved after step 2 is loaded back after the evaluation (whose codes are cached), and the
    evaluation loss is compared with a fresh engine's that loaded the same checkpoint."""

    from ds_nvfp4.nn import NVFP4Linear

    os.environ["DS_NVFP4_WEIGHT_CACHE"] = p["cache"]
    cfg = config(preset="nvfp4_zero2.json", gas=2)
    engine = make_engine(cfg)
    losses = train(engine, range(2), rank)
    if p.get("dir"):
        engine.save_checkpoint(p["dir"], tag="step2")
    losses += train(engine, range(2, 3), rank)
    losses.append(_evaluate(engine, rank))
    counts = {n: m.weight_quantizations for n, m in engine.module.named_modules() if isinstance(m, NVFP4Linear)}
    out = {"losses": losses, "counts": counts, "notes": engine.ds_nvfp4.conversion.notes}
    if p.get("dir"):
        engine.load_checkpoint(p["dir"], tag="step2")  # the step-3 weights' codes are cached at this point
        fresh = make_engine(cfg, seed=123)
        fresh.load_checkpoint(p["dir"], tag="step2")
        out["after_load"] = [_evaluate(engine, rank), _evaluate(fresh, rank)]
    return out


def _evaluate(engine, rank: int) -> float:
    engine.eval()
    with torch.no_grad():
        loss = float(engine(*batch(99, rank)))
    engine.train()
    return loss


@pytest.mark.slow
def test_weight_is_quantized_once_per_optimizer_step(tmp_path) -> None:
    """ZeRO-2, 2 micro-batches per step, block 1 activation-checkpointed, an evaluation forward at the end: with the
    cache every FP4 layer quantizes its weight once per weight version (3 steps + the weights the evaluation sees
    after the last step = 4), without it once per forward; the codes are the same, so the losses are equal bit for
    bit (a cache that missed an optimizer step's update would change them). A checkpoint load is a new weight
    version too: after loading step 2's checkpoint the evaluation equals a fresh engine's on that checkpoint (the
    cached codes of step 3's weights are dropped). Two guards stand between a load and stale codes: the feature's
    invalidation after a load and the cache's weight token (data pointer, version counter); each alone passes this
    test, removing both fails it (checked on a scratch copy)."""
    on = run_ranks(scenario_weight_cache, cache="1", dir=str(tmp_path / "ckpt"))
    off = run_ranks(scenario_weight_cache, cache="0")
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        assert a["counts"] and set(a["counts"].values()) == {4}, a["counts"]
        for name, n in b["counts"].items():
            # 3 steps x 2 micro-batches + the evaluation forward, + block 1's recomputation in each of 6 backwards
            assert n == (13 if name.startswith("blocks.1.") else 7), (name, n)
        assert any("once per optimizer step" in note for note in a["notes"])
        assert any("every forward (DS_NVFP4_WEIGHT_CACHE=0)" in note for note in b["notes"])
        # the emulated GEMMs on CPU: the allocator's note when glibc will page-fault freed buffers in again
        expected = allocator_note()
        assert (expected in a["notes"]) if expected else not any("CPU allocator" in n for n in a["notes"])
        loaded, fresh = a["after_load"]
        assert loaded == fresh and loaded != a["losses"][-1], a["after_load"]

