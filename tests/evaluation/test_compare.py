"""`ds-nvfp4 compare`: verdicts with confidence intervals, exit codes, refusal of incomparable runs, files."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.cli_in_process import run_cli

MACHINE = {"device": "cpu", "name": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "bf16_gemm": "CPU with AMX-BF16"}


def make_run(path: Path, batch_losses: list[float], *, seed: int = 0, steps: int = 100, tok_s: float = 1000.0,
             weight_bytes: int = 1000, finetune: list[float] | None = None, nvfp4: bool = False,
             machine: dict | None = MACHINE) -> Path:
    path.mkdir(parents=True)
    cfg = {"args": {"seed": seed, "steps": steps, "seq": 256, "eval_batches": len(batch_losses)},
           "model": {"layers": 5, "d_model": 128}, "data": {"sha256_train": "a", "sha256_val": "b"}, "kernel": None,
           "precision": {"enabled": True} if nvfp4 else None}
    if machine is not None:
        cfg["machine"] = machine
    (path / "config.json").write_text(json.dumps(cfg))
    rows = []
    for step in range(1, steps + 1):
        r = {"step": step, "loss": 5.0 - step / steps, "tokens_per_s": tok_s}
        if step % 50 == 0:
            scale = 1 + (steps - step) / steps
            r.update(val_loss=float(np.mean(batch_losses)) * scale,
                     val_batch_losses=[v * scale for v in batch_losses])
        rows.append(r)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"steps": steps, "tokens_per_s_median": tok_s,
                                                   "weight_bytes_per_rank": weight_bytes,
                                                   "peak_rss_bytes_per_rank": [100, 120]}))
    if finetune is not None:
        (path / "finetune.json").write_text(json.dumps({"task": "wordnet", "seeds": [0, 1, 2, 3],
                                                        "accuracy": finetune}))
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return run_cli("compare", *args)


BASE = list(np.random.default_rng(0).normal(2.5, 0.05, 32))


def test_pass(tmp_path: Path) -> None:
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", [v * 1.002 for v in BASE], tok_s=500.0, weight_bytes=300, nvfp4=True)
    r = run(str(a), str(b))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((b / "report.json").read_text())
    assert rep["verdict"] == "pass" and abs(rep["criteria"][0]["value"] - 0.002) < 1e-9
    assert rep["ratios"]["tokens_per_s"] == 0.5 and rep["ratios"]["weight_bytes_per_rank"] == 0.3
    assert "tokens/s 0.50x, weight bytes per rank 0.300x" in r.stdout  # what `make demo` prints
    assert rep["criteria"][1]["verdict"] == "not measured"
    assert (b / "report.png").read_bytes()[:4] == b"\x89PNG"
    md = (b / "report.md").read_text()
    assert "PASS" in md and "| 100 |" in md and "report.png" in md
    assert "| eval step | BF16 val loss | NVFP4 val loss |" in md


def test_fail(tmp_path: Path) -> None:
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", [v * 1.05 for v in BASE])
    assert run(str(a), str(b)).returncode == 1


def test_inconclusive_when_the_interval_straddles_the_threshold(tmp_path: Path) -> None:
    noise = np.random.default_rng(1).normal(0.0, 0.05, 32)
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", [v * (1.01 + n) for v, n in zip(BASE, noise)])
    r = run(str(a), str(b), "--out", str(tmp_path / "rep"))
    assert r.returncode == 3, r.stdout
    crit = json.loads((tmp_path / "rep" / "report.json").read_text())["criteria"][0]
    assert crit["ci"][0] < 0.01 < crit["ci"][1]


def final_eval(run_dir: Path, batch_losses: list[float], *, step: int = 100) -> None:
    """What `launch/train.py --final-eval` writes (the fields compare reads)."""
    (run_dir / "final_eval.json").write_text(json.dumps({
        "step": step, "checkpoint": f"step{step}", "eval_batches": len(batch_losses), "micro_batch": 4,
        "seq": 256, "val_loss": float(np.mean(batch_losses)), "val_batch_losses": batch_losses}))


def test_final_eval_json_decides_an_inconclusive_gap_with_more_held_out_batches(tmp_path: Path) -> None:
    """A +0.7% gap whose 32-batch interval reaches past 1% is inconclusive, and the note says how many batches
    would decide it; both runs re-evaluated on 600 batches (final_eval.json) narrow the interval to a pass."""
    rng = np.random.default_rng(3)
    base32, noise32 = list(rng.normal(2.5, 0.05, 32)), rng.normal(0.0, 0.015, 32)
    a = make_run(tmp_path / "bf16", base32)
    b = make_run(tmp_path / "nvfp4", [v * (1.007 + n) for v, n in zip(base32, noise32)], nvfp4=True)
    r = run(str(a), str(b))
    crit = json.loads((b / "report.json").read_text())["criteria"][0]
    assert r.returncode == 3 and crit["verdict"] == "inconclusive", (r.stdout, crit)
    assert "held-out batches (now 32" in crit["note"] and "--final-eval" in crit["note"], crit["note"]
    base600, noise600 = list(rng.normal(2.5, 0.05, 600)), rng.normal(0.0, 0.015, 600)
    final_eval(a, base600)
    final_eval(b, [v * (1.007 + n) for v, n in zip(base600, noise600)])
    r = run(str(a), str(b))
    crit = json.loads((b / "report.json").read_text())["criteria"][0]
    assert r.returncode == 0 and crit["verdict"] == "pass", (r.stdout, crit)
    assert "600 held-out batches (final_eval.json" in crit["note"] and crit["ci"][1] < 0.01, crit
    assert "the training's last evaluation, 32 batches: +" in crit["note"] and "-> inconclusive" in crit["note"]


def test_final_evals_of_other_windows_or_steps_are_refused_and_one_alone_is_noted(tmp_path: Path) -> None:
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", [v * 1.002 for v in BASE], nvfp4=True)
    final_eval(a, BASE)
    r = run(str(a), str(b))  # one run re-evaluated: the training's evaluations decide, and the report says why
    notes = json.loads((b / "report.json").read_text())["notes"]
    assert r.returncode == 0 and any("final_eval.json does not" in n for n in notes), notes
    final_eval(b, BASE[:16])
    r = run(str(a), str(b))
    assert r.returncode == 2 and "eval_batches (32 vs 16)" in r.stderr + r.stdout, r.stderr
    final_eval(a, BASE, step=50)
    final_eval(b, BASE, step=50)
    r = run(str(a), str(b))
    assert r.returncode == 2 and "evaluate step 50, the runs end at step 100" in r.stderr + r.stdout, r.stderr


def test_the_validation_loss_interval_is_paired_over_batches(tmp_path: Path) -> None:
    """Both runs evaluate the same held-out batches, whose losses differ far more between batches than between runs:
    resampled in pairs the interval is set by the consistent 0.5% gap; resampled independently it would be ~100x
    wider and straddle the 1% threshold."""
    wide = list(np.random.default_rng(2).normal(2.5, 0.5, 32))
    a = make_run(tmp_path / "bf16", wide)
    b = make_run(tmp_path / "nvfp4", [v * 1.005 for v in wide])
    r = run(str(a), str(b))
    crit = json.loads((b / "report.json").read_text())["criteria"][0]
    assert r.returncode == 0 and crit["verdict"] == "pass", (r.stdout, crit)
    assert crit["ci"][1] - crit["ci"][0] < 1e-3 and crit["ci"][0] <= 0.005 <= crit["ci"][1], crit["ci"]


def test_downstream_criterion(tmp_path: Path) -> None:
    a = make_run(tmp_path / "bf16", BASE, finetune=[0.50, 0.51, 0.505, 0.502])
    b = make_run(tmp_path / "nvfp4", [v * 1.001 for v in BASE], finetune=[0.499, 0.508, 0.504, 0.500])
    r = run(str(a), str(b))
    crit = json.loads((b / "report.json").read_text())["criteria"][1]
    assert crit["verdict"] == "pass" and crit["value"] == pytest.approx(0.15, abs=1e-9), r.stdout


@pytest.mark.parametrize("field, value, needle", [("seed", 1, "--seed"), ("steps", 50, "--steps")])
def test_incomparable_runs_are_refused(tmp_path: Path, field: str, value, needle: str) -> None:
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", BASE, **{field: value})
    r = run(str(a), str(b))
    assert r.returncode == 2 and needle in r.stderr


def test_different_seeds_on_request_measure_the_noise_floor(tmp_path: Path) -> None:
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "bf16_seed1", [v * 1.002 for v in BASE], seed=1)
    refused = run(str(a), str(b))
    assert refused.returncode == 2 and "--seeds-may-differ" in refused.stderr
    r = run(str(a), str(b), "--seeds-may-differ")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((b / "report.json").read_text())
    assert abs(rep["criteria"][0]["value"] - 0.002) < 1e-9
    assert any("differ in --seed (0 vs 1)" in n for n in rep["notes"]), rep["notes"]
    # two BF16 runs: told apart by their seed, not called NVFP4
    md = (b / "report.md").read_text()
    assert "| eval step | BF16 seed 0 val loss | BF16 seed 1 val loss |" in md and "NVFP4 val" not in md
    # the flag loosens the seed only
    c = make_run(tmp_path / "short", BASE, seed=1, steps=50)
    assert run(str(a), str(c), "--seeds-may-differ").returncode == 2


def test_runs_from_different_machines_are_compared_and_said_to_be(tmp_path: Path) -> None:
    """BF16 GEMM kernels differ between CPUs (AMX vs AVX512-BF16: the same 1M run's step-1 loss differs by 1.4e-5),
    so a pair from two machines is not the controlled pair a verdict assumes: the report says so."""
    a = make_run(tmp_path / "bf16", BASE)
    amd = {"device": "cpu", "name": "AMD EPYC", "bf16_gemm": "CPU with AVX512-BF16"}
    b = make_run(tmp_path / "nvfp4", [v * 1.002 for v in BASE], nvfp4=True, machine=amd)
    assert run(str(a), str(b)).returncode == 0
    notes = json.loads((b / "report.json").read_text())["notes"]
    [note] = [n for n in notes if "machine" in n]
    assert "baseline Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (cpu, BF16 GEMMs: CPU with AMX-BF16)" in note
    assert "candidate AMD EPYC (cpu, BF16 GEMMs: CPU with AVX512-BF16)" in note
    md = (b / "report.md").read_text()
    assert "AMD EPYC" in md and "| ratio (NVFP4 / BF16, different machines) | value |" in md
    assert "candidate vs baseline (different machines;" in run(str(a), str(b)).stdout
    # a run made before the field existed: said, not guessed
    c = make_run(tmp_path / "old", BASE, machine=None)
    assert run(str(c), str(b)).returncode == 0
    notes = json.loads((b / "report.json").read_text())["notes"]
    assert any("the baseline run does not record its machine" in n for n in notes), notes
    assert "ratio (NVFP4 / BF16, machine not recorded)" in (b / "report.md").read_text()
    # the same machine: nothing to say
    d = make_run(tmp_path / "same", [v * 1.002 for v in BASE], nvfp4=True)
    assert run(str(a), str(d)).returncode == 0
    assert not any("machine" in n for n in json.loads((d / "report.json").read_text())["notes"])


def test_missing_run_is_exit_2(tmp_path: Path) -> None:
    r = run(str(tmp_path / "nope"), str(tmp_path / "nope2"))
    assert r.returncode == 2 and "config.json: missing" in r.stderr


def test_too_few_seeds_is_inconclusive(tmp_path: Path) -> None:
    a = make_run(tmp_path / "bf16", BASE, finetune=[0.50, 0.51, 0.505])
    b = make_run(tmp_path / "nvfp4", [v * 1.001 for v in BASE], finetune=[0.50, 0.51, 0.505])
    for f, acc in ((a, [0.50, 0.51, 0.505]), (b, [0.50, 0.51, 0.505])):
        (f / "finetune.json").write_text(json.dumps({"task": "wordnet", "seeds": [0, 1, 2], "accuracy": acc}))
    r = run(str(a), str(b))
    crit = json.loads((b / "report.json").read_text())["criteria"][1]
    assert crit["verdict"] == "inconclusive" and "fewer than 4 seeds" in crit["note"] and r.returncode == 3


def _write_per_example(run_dir: Path, correct: np.ndarray, **extra) -> None:
    import torch

    from ds_nvfp4.evaluation.finetune import pack_correct

    res = {"task": "wordnet", "seeds": list(range(len(correct))), "accuracy": correct.mean(1).tolist(),
           "steps": 400, "batch": 32, "lr": 3e-4, "test_examples": correct.shape[1], "test_sha256": "t",
           "correct": [pack_correct(torch.from_numpy(c)) for c in correct]}
    res.update(extra)
    (run_dir / "finetune.json").write_text(json.dumps(res))


def test_per_example_results_round_trip() -> None:
    import torch

    from ds_nvfp4.evaluation.acceptance import unpack_correct
    from ds_nvfp4.evaluation.finetune import pack_correct

    for n in (1, 7, 8, 9, 1001):
        bits = np.random.default_rng(n).random(n) < 0.3
        assert (unpack_correct(pack_correct(torch.from_numpy(bits)), n) == bits).all()


@pytest.mark.parametrize("flip, verdict", [(0.002, "pass"), (0.03, "fail"), (0.007, "inconclusive")])
def test_downstream_two_level_bootstrap(tmp_path: Path, flip: float, verdict: str) -> None:
    """Candidate = baseline with a fraction ``flip`` of correct answers turned wrong (a known gap in points), plus
    per-seed noise of 1% disagreement both ways; the interval must contain the true gap and judge it."""
    rng = np.random.default_rng(3)
    n = 20000
    base = rng.random((4, n)) < 0.4
    cand = base.copy()
    noise = rng.random((4, n)) < 0.01
    cand[noise] = ~cand[noise]
    lost = base & (rng.random((4, n)) < flip / 0.4)
    cand[lost] = False
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", [v * 1.001 for v in BASE])
    _write_per_example(a, base)
    _write_per_example(b, cand)
    r = run(str(a), str(b))
    crit = json.loads((b / "report.json").read_text())["criteria"][1]
    true_gap = 100 * (base.mean() - cand.mean())
    assert crit["ci"][0] <= true_gap <= crit["ci"][1], (crit, true_gap)
    assert crit["verdict"] == verdict and "test examples" in crit["note"], (crit, r.stdout)


def test_downstream_refuses_different_test_sets(tmp_path: Path) -> None:
    base = np.random.default_rng(0).random((4, 100)) < 0.5
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", BASE)
    _write_per_example(a, base)
    _write_per_example(b, base, test_sha256="other")
    r = run(str(a), str(b))
    assert r.returncode == 2 and "test_sha256" in r.stderr and "same command" in r.stderr


def _write_probe(run_dir: Path, correct: np.ndarray, **over) -> None:
    import torch

    from ds_nvfp4.evaluation.finetune import pack_correct

    res = {"task": "wordnet", "examples": len(correct), "folds": 5, "seq": 64, "l2": 1e-3, "iterations": 100,
           "examples_sha256": "s", "features": "f", "accuracy": float(correct.mean()),
           "correct": pack_correct(torch.from_numpy(correct))}
    res.update(over)
    (run_dir / "probe.json").write_text(json.dumps(res))


@pytest.mark.parametrize("lost, verdict, code", [(0.0, "pass", 0), (0.03, "fail", 1), (0.005, "inconclusive", 3)])
def test_the_linear_probe_decides_the_downstream_verdict(tmp_path: Path, lost: float, verdict: str,
                                                         code: int) -> None:
    """With probe.json on both runs the probe's gap (paired bootstrap over examples) is the downstream criterion and
    the seed-noisy fine-tunes are shown as supporting evidence (here inconclusive: 3 seeds) without holding back the
    verdict. Candidate = baseline with 2% of answers flipped both ways and a fraction ``lost`` of correct ones
    turned wrong."""
    rng = np.random.default_rng(5)
    n = 40000
    base = rng.random(n) < 0.45
    cand = base.copy()
    flip = rng.random(n) < 0.02
    cand[flip] = ~cand[flip]
    cand[base & (rng.random(n) < lost / 0.45)] = False
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", BASE)
    _write_per_example(a, np.stack([base] * 3))
    _write_per_example(b, np.stack([base] * 3), accuracy=[0.44, 0.45, 0.46])
    _write_probe(a, base)
    _write_probe(b, cand)
    r = run(str(a), str(b))
    report = json.loads((b / "report.json").read_text())
    probe, fine = report["criteria"][1], report["criteria"][2]
    assert probe["name"].endswith("(linear probe)") and fine["counts"] is False and probe["counts"] is True
    true_gap = 100 * (base.mean() - cand.mean())
    assert probe["ci"][0] <= true_gap <= probe["ci"][1], (probe, true_gap)
    assert probe["verdict"] == verdict and fine["verdict"] == "inconclusive", report["criteria"]
    assert r.returncode == code and "supporting evidence" in r.stdout, r.stdout
    if verdict == "inconclusive":  # says how many examples would decide it: n (half-width / room)^2
        half, room = (probe["ci"][1] - probe["ci"][0]) / 2, abs(0.5 - probe["value"])
        assert f"~{math.ceil(n * (half / room) ** 2):,} examples (now {n:,}" in probe["note"], probe["note"]
    else:
        assert "a verdict needs" not in probe["note"]


def test_probes_of_different_settings_are_refused(tmp_path: Path) -> None:
    base = np.random.default_rng(0).random(100) < 0.5
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", BASE)
    _write_probe(a, base)
    _write_probe(b, base, l2=0.1)
    r = run(str(a), str(b))
    assert r.returncode == 2 and "probe results differ in l2" in r.stderr


def test_a_run_resumed_on_another_machine_type_is_not_a_same_machine_run(tmp_path: Path) -> None:
    """launch/train.py --allow-machine-change records each part's machine (config.json "machines"): such a run is
    reported as mixing two types, even when its last part ran where its partner did."""
    from ds_nvfp4.evaluation.seedset import machine_label

    amd = {"device": "cpu", "name": "AMD EPYC", "bf16_gemm": "CPU with AVX512-BF16"}
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", [v * 1.002 for v in BASE], nvfp4=True)
    cfg = json.loads((b / "config.json").read_text())
    cfg["machines"] = [{"from_step": 0, "machine": amd}, {"from_step": 400, "machine": MACHINE}]
    (b / "config.json").write_text(json.dumps(cfg))
    assert run(str(a), str(b)).returncode == 0
    rep = json.loads((b / "report.json").read_text())
    [note] = [n for n in rep["notes"] if "resumed" in n]
    assert "the candidate run changed machine type" in note and "from step 0: AMD EPYC" in note, note
    assert "from step 400: Intel(R) Xeon(R) Platinum 8481C" in note, note
    assert "ratio (NVFP4 / BF16, different machines)" in (b / "report.md").read_text()
    assert machine_label(cfg) == ("AMD EPYC (CPU with AVX512-BF16), then Intel(R) Xeon(R) Platinum 8481C CPU @ "
                                  "2.70GHz (CPU with AMX-BF16) from step 400")
    assert machine_label({"machine": amd, "machines": [{"from_step": 0, "machine": amd}]}) == \
        "AMD EPYC (CPU with AVX512-BF16)"
