"""The engine's schedule features as pure functions of what they observe: the learning-rate decay finder
(engine/schedule.py ``LrDecay``) and the loss-spike guard (engine/spike_guard.py ``SpikeGuard``)."""

from __future__ import annotations


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
    from pathlib import Path

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
