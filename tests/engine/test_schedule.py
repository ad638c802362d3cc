"""The engine's schedule features as pure functions of what they observe: the learning-rate decay finder
(engine/schedule.py ``LrDecay``) and the loss-spike guard (engine/spike_guard.py ``SpikeGuard``); then the schedule
feature on 2 real ranks (warm-up, late switch, lr_decay, spike guard, each resumed from checkpoints)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.ranks import run_ranks
from tests.zero.engines import (
    Net,
    batch,
    config,
    exactness,
    make_engine,
    train,
)


def test_lr_decay_is_found_after_a_constant_stretch_only() -> None:
    """``bf16_from: "lr_decay"`` (engine/schedule.py ``LrDecay``): the first falling step after >= 2 constant ones;
    a fall straight after the warm-up is reported, not taken; a step seen again (a resumed run) is not counted."""
    from ds_nvfp4.engine.schedule import LrDecay

    def run(lrs, start=1):
        d = LrDecay()
        for i, lr in enumerate(lrs, start):
            d.observe(i, lr)
        return d

    wsd = run([1e-4, 2e-4, 2e-4, 2e-4, 1e-4, 5e-5])
    assert (wsd.found, wsd.no_plateau_at) == (5, None)
    assert run([1e-4, 2e-4, 2e-4, 1e-4]).to_dict()["no_plateau_at"] == 4  # one constant step is not a stretch
    cosine = run([1e-4, 2e-4, 1.9e-4, 1e-4])
    assert (cosine.found, cosine.no_plateau_at) == (None, 3)
    assert run([3e-4] * 6).done is False  # constant: still watching
    resumed = LrDecay(**run([1e-4, 2e-4, 2e-4]).to_dict())
    resumed.observe(3, 2e-4)  # the step the checkpoint had seen already
    resumed.observe(4, 2e-4)
    resumed.observe(5, 1e-4)
    assert resumed.found == 5 and resumed.stable_steps == 2


def test_spike_guard_opens_bounded_episodes_on_fp4_loss_spikes_only() -> None:
    """``schedule.spike_guard`` (engine/spike_guard.py ``SpikeGuard``): no episode before ``window`` losses are
    seen; a loss above ``loss_ratio`` x the median of the previous ``window`` non-spike losses opens steps
    step+1..step+bf16_steps; a spike in a BF16 step or inside an episode opens none; past ``max_episodes`` a spike
    is only reported; the state survives to_dict/from_dict (a resumed run), a step seen again is not counted."""
    from ds_nvfp4.config.schema import SpikeGuardConfig
    from ds_nvfp4.engine.spike_guard import SpikeGuard

    g = SpikeGuard(SpikeGuardConfig(window=3, loss_ratio=1.5, bf16_steps=2, max_episodes=2))
    seen = [g.observe(s, v, ran_fp4=True) for s, v in enumerate([9.0, 4.0, 4.2, 4.0], 1)]
    assert seen == [None] * 4  # 9.0 at step 1: no history yet (an early loss is not a spike)
    assert g.observe(5, 8.0, ran_fp4=False) is None  # a BF16 step's spike is not the format's
    skipped = SpikeGuard(g.config, history=[4.0, 4.0, 4.0])
    assert skipped.observe(5, float("nan"), ran_fp4=True) is None and skipped.history == [4.0] * 3  # NaN: skipped
    ep = g.observe(6, 8.0, ran_fp4=True)  # median of (4.2, 4.0, 8.0) = 4.2: 8.0 > 6.3
    assert (ep.detected_at, ep.start, ep.end, ep.median) == (6, 7, 8, 4.2)
    assert [g.bf16_at(s) for s in (6, 7, 8, 9)] == [False, True, True, False]
    assert g.history == [4.2, 4.0, 8.0]  # the spike's loss stays out of the median
    assert g.observe(7, 20.0, ran_fp4=True) is None  # inside the episode
    resumed = SpikeGuard.from_dict(g.config, g.to_dict())
    assert resumed.observe(7, 99.0, ran_fp4=True) is None and resumed.to_dict() == g.to_dict()  # seen already
    for guard in (g, resumed):
        assert guard.observe(8, 4.0, ran_fp4=True) is None
        assert guard.observe(9, 50.0, ran_fp4=True).start == 10  # median (8.0, 20.0, 4.0) = 8.0
        assert guard.observe(12, 90.0, ran_fp4=True) == 12  # the budget (2 episodes) is spent: reported only
        assert guard.ignored == [12] and len(guard.episodes) == 2


def test_spike_guard_on_the_kept_10m_runs_fires_at_the_fp4_warmup_spike_only() -> None:
    """The defaults on the per-step losses of the kept 10M runs (docs/evidence/10m): the FP4-from-step-1 run that
    failed (+7.6%) opens one episode, at its spike (step 19: loss 9.05); the shipped preset's FP4 phase (after its
    BF16 warm-up, which took the spike at step 18) and its second seed open none."""
    import gzip
    import json

    from ds_nvfp4.config.schema import SpikeGuardConfig
    from ds_nvfp4.engine.spike_guard import SpikeGuard

    def episodes(run: str, warmup: int) -> list[tuple[int, int, int]]:
        g = SpikeGuard(SpikeGuardConfig())
        path = Path(__file__).parents[2] / "docs" / "evidence" / "10m" / run / "metrics.jsonl.gz"
        with gzip.open(path, "rt") as rows:
            for row in map(json.loads, rows):
                if "loss" in row:
                    g.observe(row["step"], row["loss"], ran_fp4=row["step"] > warmup)
        return [(e.detected_at, e.start, e.end) for e in g.episodes]

    assert episodes("nvfp4_zero3_v1", 0) == [(19, 20, 69)]
    assert episodes("nvfp4_zero3", 50) == [] and episodes("nvfp4_zero3_seed1", 50) == []


def test_lr_decay_counts_a_constant_stretch_only_since_the_rate_last_rose() -> None:
    """A stepwise warm-up has flat stretches; they are not the plateau: the count restarts when the rate rises, so
    the fall right after the warm-up's last step is reported (no plateau), not taken for decay."""
    from ds_nvfp4.engine.schedule import LrDecay

    d = LrDecay()
    for step, lr in enumerate([1e-4, 1e-4, 1e-4, 2e-4, 1.5e-4], 1):
        d.observe(step, lr)
    assert (d.found, d.no_plateau_at) == (None, 5)


def test_spike_guard_state_keeps_the_spikes_past_its_budget() -> None:
    """A resumed run (to_dict / from_dict) still knows the spikes it only reported after its budget was spent."""
    from ds_nvfp4.config.schema import SpikeGuardConfig
    from ds_nvfp4.engine.spike_guard import SpikeGuard

    g = SpikeGuard(SpikeGuardConfig(window=3, loss_ratio=1.5, bf16_steps=1, max_episodes=1))
    for step, loss in enumerate([4.0, 4.0, 4.0, 9.0, 4.0, 4.0, 9.5, 4.0], 1):
        g.observe(step, loss, ran_fp4=True)
    assert g.ignored == [7] and len(g.episodes) == 1
    resumed = SpikeGuard.from_dict(g.config, g.to_dict())
    assert resumed.ignored == [7] and resumed.to_dict() == g.to_dict()



# -- on real ranks ------------------------------------------------------------------------------------------


def scenario_schedule(rank: int, p: dict) -> dict:
    """precision.schedule on 7 steps: 1-2 BF16 warm-up, 3-4 FP4, 5-7 the late switch. Checkpoints at steps 2, 4 and
    5 (either side of each switch); a fresh engine resumes from each and trains to step 7. Plus the first 2 steps of
    a plain BF16 engine from the same initial weights."""
    import ds_nvfp4

    sched = {"bf16_warmup_steps": 2, "bf16_from": p.get("bf16_from", 5), "bf16_gemms": p.get("gemms", "forward")}
    cfg = config(**{"precision.schedule": sched, **p.get("config", {})})
    ckpt = p["dir"]
    e1 = make_engine(copy.deepcopy(cfg))
    phases, packed, bf16_only, losses, exact = [], [], [], [], []
    for step in range(7):
        store = e1.ds_nvfp4.store
        phases.append(e1.ds_nvfp4.schedule.current.name)
        packed.append(ds_nvfp4.storage_report(e1).packed_params if store is not None else None)
        bf16_only.append(e1.module.blocks[1].fc1.bf16_only)
        exact.append(all(v["equal"] for v in exactness(e1).values() if v["packed"]) if store and store.packed
                     else None)
        losses += train(e1, range(step, step + 1), rank)
        if step + 1 in (2, 4, 5):
            e1.save_checkpoint(ckpt, tag=f"step{step + 1}")
    base = make_engine(config(preset="bf16_zero3.json"))
    bf16 = train(base, range(2), rank)
    resumed = {}
    cfg.pop("csv_monitor", None)  # the monitor's rows are those of the uninterrupted run
    for tag in (2, 4, 5):
        e = make_engine(copy.deepcopy(cfg), seed=123)
        e.load_checkpoint(ckpt, tag=f"step{tag}")
        resumed[tag] = train(e, range(tag, 7), rank)
    return {"phases": phases, "packed": packed, "bf16_only": bf16_only, "exact": exact, "losses": losses,
            "bf16": bf16, "resumed": resumed, "schedule": e1.ds_nvfp4.schedule.to_dict(),
            "share": e1.ds_nvfp4.fp4_gemm_share(7), "notes": e1.ds_nvfp4.conversion.notes}


def scenario_lr_decay(rank: int, p: dict) -> dict:
    """``bf16_from: "lr_decay"`` with a client LambdaLR (``p["factors"]``: the learning-rate factor of each step):
    the phase of each of 7 steps, what was found, the warnings; with ``p["resume"]``, fresh engines resumed from
    checkpoints at steps 4 and 6 train to step 7 (phases and losses)."""
    import logging

    import ds_nvfp4

    factors = p["factors"]
    cfg = config(**{"precision.schedule": {"bf16_from": "lr_decay"}})
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("ds_nvfp4").addHandler(Keep(level=logging.WARNING))

    def engine(seed: int = 0):
        torch.manual_seed(seed)
        model = Net()
        e, *_ = ds_nvfp4.initialize(
            model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: factors[min(i, 6)]))
        return e

    e1 = engine()
    phases, losses = [], []
    for step in range(7):
        phases.append(e1.ds_nvfp4.schedule.current.name)
        losses += train(e1, range(step, step + 1), rank)
        if p.get("resume") and step + 1 in (4, 6):
            e1.save_checkpoint(p["dir"], tag=f"step{step + 1}")
    out = {"phases": phases, "losses": losses, "schedule": e1.ds_nvfp4.schedule.to_dict(), "warnings": warnings,
           "notes": e1.ds_nvfp4.conversion.notes}
    if p.get("resume"):
        out["resumed"] = {}
        for tag in (4, 6):
            e = engine(seed=123)
            e.load_checkpoint(p["dir"], tag=f"step{tag}")
            got_phases, got_losses = [], []
            for step in range(tag, 7):
                got_phases.append(e.ds_nvfp4.schedule.current.name)
                got_losses += train(e, range(step, step + 1), rank)
            out["resumed"][tag] = {"phases": got_phases, "losses": got_losses}
    return out


def scenario_spike_guard(rank: int, p: dict) -> dict:
    """``schedule.spike_guard`` (window 3, ratio 1.5, 2 BF16 steps, 1 episode) on 9 steps of packed ZeRO-3. Rank 1
    alone multiplies its loss by 8 at steps 6 and 9 (``p["spikes"]``), so only the pooled loss makes rank 0 see the
    spike: steps 7-8 must run BF16 on both ranks, the spike at step 9 finds the budget spent. A fresh engine resumed
    from the checkpoint at step 7 (inside the episode) must repeat the phases and losses of steps 8-9."""
    import logging

    import ds_nvfp4

    guard = {"window": 3, "loss_ratio": 1.5, "bf16_steps": 2, "max_episodes": 1}
    cfg = config(**{"precision.schedule": {"spike_guard": guard}, **p.get("config", {})})
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("ds_nvfp4").addHandler(Keep(level=logging.WARNING))

    def run(engine, steps: range) -> tuple[list[str], list[float], list, list[bool]]:
        phases, losses, packed, bf16_only = [], [], [], []
        for step in steps:
            phases.append(engine.ds_nvfp4.schedule.current.name)
            report = ds_nvfp4.storage_report(engine)  # None below ZeRO-3: DeepSpeed stores the weights
            packed.append(report.packed_params if report is not None else 0)
            bf16_only.append(engine.module.blocks[1].fc1.bf16_only)
            loss = engine(*batch(step, rank))
            if rank == 1 and step + 1 in p["spikes"]:
                loss = loss * 8.0
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            if step + 1 == 7:
                engine.save_checkpoint(p["dir"], tag="step7")
        return phases, losses, packed, bf16_only

    e1 = make_engine(copy.deepcopy(cfg))
    phases, losses, packed, bf16_only = run(e1, range(9))
    out = {"phases": phases, "losses": losses, "packed": packed, "bf16_only": bf16_only, "warnings": warnings,
           "schedule": e1.ds_nvfp4.schedule.to_dict(), "share": e1.ds_nvfp4.fp4_gemm_share(9),
           "share_planned": e1.ds_nvfp4.schedule.plan.fp4_share(
               9, sum(d.params for d in e1.ds_nvfp4.conversion.layers if d.fp4),
               sum(d.params for d in e1.ds_nvfp4.conversion.layers)),
           "notes": e1.ds_nvfp4.conversion.notes}
    cfg.pop("csv_monitor", None)  # the monitor's rows are those of the uninterrupted run
    e2 = make_engine(copy.deepcopy(cfg), seed=123)
    e2.load_checkpoint(p["dir"], tag="step7")
    got_phases, got_losses, _, _ = run(e2, range(7, 9))
    out["resumed"] = {"phases": got_phases, "losses": got_losses}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("preset,gemms", [("nvfp4_zero3.json", "forward"), ("nvfp4_full_zero3.json", "backward")])
def test_precision_schedule_warmup_late_switch_and_resume(tmp_path, preset: str, gemms: str) -> None:
    """precision.schedule under packed ZeRO-3: the BF16 warm-up is plain BF16 training (losses equal a BF16 engine's
    bit for bit), storage is packed exactly from the masters only in the FP4 phase, the late switch turns the named
    GEMMs BF16 (forward: BF16 weights too), and runs resumed from checkpoints on either side of a switch repeat the
    uninterrupted run's losses exactly."""
    res = run_ranks(scenario_schedule, dir=str(tmp_path / "ckpt"), gemms=gemms,
                    config={"preset": preset, "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                              "job_name": "job"}})
    for r in res:
        assert r["phases"] == ["warmup"] * 2 + ["fp4"] * 2 + ["late"] * 3
        assert r["losses"][:2] == r["bf16"], (r["losses"][:2], r["bf16"])  # warm-up: BF16 training itself
        late_packed = gemms == "backward"
        assert [n > 0 for n in r["packed"]] == [False] * 2 + [True] * 2 + [late_packed] * 3
        assert r["exact"][2:4] == [True, True]  # FP4 phase: the packed weights are the quantized masters
        assert r["bf16_only"] == [True] * 2 + [False] * 2 + [gemms == "forward" and preset == "nvfp4_zero3.json"] * 3
        for tag, rest in r["resumed"].items():
            assert rest == r["losses"][int(tag):], (tag, rest, r["losses"])
        assert [t["phase"] for t in r["schedule"]["transitions"]] == ["warmup", "fp4", "late"]
        assert any("precision.schedule" in n for n in r["notes"])
    fwd = [ln.split(",") for ln in (tmp_path / "job" / "Train_Precision_fp4_forward.csv").read_text().splitlines()[1:]]
    assert [(int(s), float(v)) for s, v in fwd] == [(s, float(s in (3, 4) or (s >= 5 and gemms == "backward")))
                                                    for s in range(1, 8)]


#: learning-rate factors per step: warm-up (steps 1-2), constant (3-5), decay from step 6
WSD = [0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.25]


@pytest.mark.slow
def test_late_switch_at_the_start_of_learning_rate_decay_found_from_the_run_and_resumed(tmp_path) -> None:
    """``bf16_from: "lr_decay"`` under a warmup-stable-decay LambdaLR: FP4 until step 5, the late phase from step 6
    (where the learning rate first falls after its constant stretch); checkpoints before and after the switch
    resume to the same phases and losses (what was found is saved in ds_nvfp4.json)."""
    res = run_ranks(scenario_lr_decay, factors=WSD, resume=True, dir=str(tmp_path / "ckpt"))
    for r in res:
        assert r["phases"] == ["fp4"] * 5 + ["late"] * 2, r["phases"]
        assert r["schedule"]["first_late_step"] == 6 and r["schedule"]["lr_decay"]["found"] == 6
        assert r["warnings"] == []
        for tag, got in r["resumed"].items():
            assert got["phases"] == r["phases"][int(tag):], (tag, got)
            assert got["losses"] == r["losses"][int(tag):], (tag, got)
    meta = json.loads((tmp_path / "ckpt" / "step4" / "ds_nvfp4.json").read_text())
    saved = meta["features"]["schedule"]["lr_decay"]
    assert saved["found"] is None and saved["stable_steps"] == 3


@pytest.mark.slow
def test_lr_decay_switch_with_a_schedule_that_has_no_constant_stretch_says_there_is_no_switch() -> None:
    res = run_ranks(scenario_lr_decay, factors=[0.5, 1.0, 0.9, 0.7, 0.5, 0.3, 0.1])
    by_rank = {r["rank"]: r for r in res}
    for r in res:
        assert r["phases"] == ["fp4"] * 7 and r["schedule"]["first_late_step"] is None
        assert r["schedule"]["lr_decay"]["no_plateau_at"] == 3
    assert any("NO late BF16 switch" in w and "from step 3" in w for w in by_rank[0]["warnings"]), by_rank[0]


@pytest.mark.slow
@pytest.mark.parametrize("preset", [None, pytest.param("nvfp4_zero2.json", marks=pytest.mark.slow),
                                    pytest.param("nvfp4_zero3_offload.json", marks=pytest.mark.slow)],
                         ids=["zero3", "zero2", "zero3_offload"])
def test_spike_guard_runs_bf16_after_a_pooled_loss_spike_on_every_rank_and_resumes(tmp_path, preset) -> None:
    """``schedule.spike_guard``: a spike on one rank only (rank 1's loss x8 at step 6) opens the same BF16 episode
    on both ranks (the loss is pooled), steps 7-8 run BF16 with BF16 weights and step 9 FP4 on packed weights
    again; the second spike (step 9) finds the one episode spent and is reported; a run resumed inside the episode
    repeats it; the monitor records the episode. The same under the other presets that ship the guard: ZeRO-2
    (BF16 storage: nothing is packed, the FP4 GEMMs quantize on the fly) and the offloaded optimizer."""
    config = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    res = run_ranks(scenario_spike_guard, spikes=[6, 9], dir=str(tmp_path / "ckpt"),
                    config=config if preset is None else {**config, "preset": preset})
    for r in res:
        assert r["phases"] == ["fp4"] * 6 + ["guard"] * 2 + ["fp4"], r["phases"]  # steps 1..9
        packed = [False] * 9 if preset == "nvfp4_zero2.json" else [True] * 6 + [False] * 2 + [True]
        assert [n > 0 for n in r["packed"]] == packed
        assert r["bf16_only"] == [False] * 6 + [True] * 2 + [False]
        eps = r["schedule"]["spike_guard"]["episodes"]
        assert [(e["detected_at"], e["start"], e["end"]) for e in eps] == [(6, 7, 8)], eps
        assert r["schedule"]["spike_guard"]["ignored"] == [9]
        assert [t["phase"] for t in r["schedule"]["transitions"]] == ["fp4", "guard", "fp4"]
        assert r["share"] == pytest.approx(r["share_planned"] * 7 / 9)  # 2 of 9 steps ran BF16
        assert r["resumed"] == {"phases": r["phases"][7:], "losses": r["losses"][7:]}, r["resumed"]
        assert any("spike guard" in n for n in r["notes"]), r["notes"]
    by_rank = {r["rank"]: r for r in res}
    assert any("step 9" in w and "episodes (max_episodes) are spent" in w for w in by_rank[0]["warnings"]), \
        by_rank[0]["warnings"]
    rows = (tmp_path / "job" / "Train_Precision_spike_guard_episodes.csv").read_text().splitlines()[1:]
    assert [tuple(map(float, row.split(","))) for row in rows] == [(6.0, 1.0)]
    fwd = [ln.split(",") for ln in (tmp_path / "job" / "Train_Precision_fp4_forward.csv").read_text().splitlines()[1:]]
    assert [float(v) for _, v in fwd] == [1.0] * 6 + [0.0] * 2 + [1.0]

