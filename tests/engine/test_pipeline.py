"""A DeepSpeed PipelineEngine through ds_nvfp4.initialize on 2 real ranks (one stage each)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

from tests.ranks import run_ranks
from tests.zero.engines import (
    Block,
    batch,
    config,
)


class _Embed(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)

    def forward(self, idx):
        return self.embed(idx)


class _Head(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64) -> None:
        super().__init__()
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, h):
        return self.lm_head(h).float()


def _pipe_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _pipeline_engine(p: dict, cache: str = "1", **over):
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_nvfp4

    os.environ["DS_NVFP4_WEIGHT_CACHE"] = cache
    torch.manual_seed(0)
    specs = [LayerSpec(_Embed)] + [LayerSpec(Block, 64) for _ in range(4)] + [LayerSpec(_Head)]
    model = PipelineModule(layers=specs, num_stages=2, loss_fn=_pipe_loss, partition_method="uniform")
    cfg = config(preset="nvfp4_zero2.json", gas=2, **{"zero_optimization.stage": 1, **over})
    engine, *_ = ds_nvfp4.initialize(model=model, model_parameters=[q for q in model.parameters()
                                                                    if q.requires_grad], config=cfg)
    return engine


def _pipe_data(rank_seed: int = 0):
    step = 0
    while True:
        idx, tgt = batch(step, 0)  # every stage draws the same batches (the first reads inputs, the last labels)
        step += 1
        yield idx, tgt


def scenario_pipeline(rank: int, p: dict) -> dict:
    """A PipelineModule in 2 stages (ZeRO-1): FP4 layers per stage, the lifecycle through train_batch (cache on and
    off equal, schedule phases, resume from a checkpoint), and a NaN stops every rank with NonFiniteError."""
    import ds_nvfp4
    from ds_nvfp4.nn import NVFP4Linear

    out: dict = {}
    for cache in ("1", "0"):
        engine = _pipeline_engine(p, cache)
        data = _pipe_data()
        out[f"losses_cache{cache}"] = [float(engine.train_batch(data)) for _ in range(4)]
    out["conversion"] = engine.ds_nvfp4.conversion.to_dict()
    out["fp4_layers"] = sorted(n for n, m in engine.module.named_modules() if isinstance(m, NVFP4Linear))
    out["type"] = type(engine).__name__
    out["seam_scopes"] = list(engine.ds_nvfp4.seam_scopes)
    out["stats_when_monitor_off"] = engine.ds_nvfp4.stats is None
    # the spike guard reads train_batch's loss (a PipelineEngine's backward is internal): its history is that loss
    sched = {"bf16_warmup_steps": 1, "spike_guard": {}}
    engine = _pipeline_engine(p, "1", **{"precision.schedule": sched})
    data = _pipe_data()
    phases, losses = [], []
    for step in range(4):
        phases.append(engine.ds_nvfp4.schedule.current.name)
        losses.append(float(engine.train_batch(data)))
        if step == 1:
            engine.save_checkpoint(p["dir"], tag="step2")
    out["phases"], out["schedule_losses"] = phases, losses
    out["guard"] = engine.ds_nvfp4.schedule.to_dict()["spike_guard"]
    resumed = _pipeline_engine(p, "1", **{"precision.schedule": sched})
    resumed.load_checkpoint(p["dir"], tag="step2")
    data = _pipe_data()
    for _ in range(2):  # the batches of steps 1-2, consumed
        next(data), next(data)
    out["resumed_losses"] = [float(resumed.train_batch(data)) for _ in range(2)]
    engine = _pipeline_engine(p, "1")
    layer = next(m for m in engine.module.modules() if isinstance(m, NVFP4Linear))
    bad = {3}

    def poison(module, args):
        return (args[0] * float("nan"),) if module.training and engine.global_steps + 1 in bad else None

    if rank == 0:
        layer.register_forward_pre_hook(poison)
    data = _pipe_data()
    try:
        for _ in range(5):
            engine.train_batch(data)
        out["error"] = None
    except ds_nvfp4.NonFiniteError as exc:
        out["error"], out["raised_at"] = str(exc), engine.global_steps
    return out


@pytest.mark.slow
def test_pipeline_engine_gets_fp4_layers_and_every_feature(tmp_path) -> None:
    res = run_ranks(scenario_pipeline, dir=str(tmp_path / "ckpt"))
    for r in res:
        assert r["type"].startswith("NVFP4PipelineEngine")
        # the pipeline's DeepSpeed names (train_batch, layer specs, stage grid) were checked at start-up
        assert r["seam_scopes"] == ["engine", "pipeline"] and r["stats_when_monitor_off"], r["seam_scopes"]
        assert r["losses_cache1"] == r["losses_cache0"] and all(math.isfinite(v) for v in r["losses_cache1"])
        assert r["phases"] == ["warmup", "fp4", "fp4", "fp4"]
        assert r["resumed_losses"] == r["schedule_losses"][2:], (r["resumed_losses"], r["schedule_losses"])
        # the spike guard saw train_batch's loss of each step (identical on both stages), and no spike
        assert r["guard"]["history"] == r["schedule_losses"] and r["guard"]["episodes"] == [], r["guard"]
        assert r["error"] is not None and r["raised_at"] == 3, r.get("error")
        notes = " ".join(r["conversion"]["notes"])
        assert f"pipeline stage {r['rank']} of 2" in notes
    # 4 blocks over 2 stages; the first and the last block stay BF16 (keep_first/last_blocks_bf16: 1)
    by_rank = {r["rank"]: r for r in res}
    assert by_rank[0]["fp4_layers"] == ["2.fc1", "2.fc2"] and by_rank[1]["fp4_layers"] == ["3.fc1", "3.fc2"]
    reasons = {d["name"]: d["reason"] for r in res for d in r["conversion"]["layers"]}
    assert "in block 0 of 4" in reasons["1.fc1"] and "in block 3 of 4" in reasons["4.fc1"]

