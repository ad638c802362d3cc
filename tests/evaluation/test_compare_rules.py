"""`compare` judges the *last* common evaluation, and refuses every kind of incomparable pair (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.evaluation.test_compare import BASE, make_run, run


def _scale_eval(run_dir: Path, step: int, factor: float) -> None:
    """Multiply one evaluation of a run by ``factor`` (its mean and its per-batch losses)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["step"] == step:
            r["val_loss"] *= factor
            r["val_batch_losses"] = [v * factor for v in r["val_batch_losses"]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize(("early", "late", "code"), [(1.05, 1.002, 0), (1.002, 1.05, 1)])
def test_the_verdict_is_the_final_evaluations(tmp_path: Path, early: float, late: float, code: int) -> None:
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", BASE)
    _scale_eval(b, 50, early)
    _scale_eval(b, 100, late)
    r = run(str(a), str(b))
    assert r.returncode == code, r.stdout + r.stderr
    crit = json.loads((b / "report.json").read_text())["criteria"][0]
    assert abs(crit["value"] - (late - 1)) < 1e-9 and "step 100" in crit["note"]


RULES = [
    ("data", lambda c, s: c["data"].update(sha256_train="other")),
    ("validation data", lambda c, s: c["data"].update(sha256_val="other")),
    ("--seed", lambda c, s: c["args"].update(seed=7)),
    ("--steps", lambda c, s: c["args"].update(steps=200)),
    ("model", lambda c, s: c["model"].update(layers=6)),
    ("--seq", lambda c, s: c["args"].update(seq=128)),
    ("--eval-batches", lambda c, s: c["args"].update(eval_batches=16)),
    ("steps run", lambda c, s: s.update(steps=90)),
]


@pytest.mark.parametrize(("what", "change"), RULES, ids=[w for w, _ in RULES])
def test_incomparable_runs_are_refused_naming_the_difference(tmp_path: Path, what: str, change) -> None:
    a = make_run(tmp_path / "bf16", BASE)
    b = make_run(tmp_path / "nvfp4", BASE)
    cfg, summary = json.loads((b / "config.json").read_text()), json.loads((b / "summary.json").read_text())
    change(cfg, summary)
    (b / "config.json").write_text(json.dumps(cfg))
    (b / "summary.json").write_text(json.dumps(summary))
    r = run(str(a), str(b))
    assert r.returncode == 2 and f"differ in {what} " in r.stderr, r.stderr
