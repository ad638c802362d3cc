"""`ds-nvfp4 compare --baselines ... --candidates ...`: seed sets paired by seed, the mean paired gap's t interval."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ds_nvfp4.evaluation.seedset import seeds_needed, t975, t_interval
from tests.evaluation.test_compare import BASE, make_run, run

PROTOCOL = {"name": "v3", "steps": 100, "final_eval": True, "deviations": {}}


def _set(root: Path, gaps: list[float], *, protocol: dict | None = PROTOCOL, whole: bool = True,
         bf16_offsets: list[float] | None = None) -> tuple[list[str], list[str]]:
    """BF16 and NVFP4 runs for seeds 0..n-1: NVFP4's batch losses are BF16's times (1 + gap)."""
    base, cand = [], []
    for seed, gap in enumerate(gaps):
        off = 1 + (bf16_offsets[seed] if bf16_offsets else 0.0)
        losses = [v * off for v in BASE]
        for name, vals, nvfp4 in (("bf16", losses, False), ("nvfp4", [v * (1 + gap) for v in losses], True)):
            r = make_run(root / f"{name}_seed{seed}", vals, seed=seed, nvfp4=nvfp4)
            cfg = json.loads((r / "config.json").read_text())
            cfg["protocol"] = protocol
            cfg["final_eval"] = {"batches": len(vals), "whole_split": whole} if protocol else None
            (r / "config.json").write_text(json.dumps(cfg))
            (r / "final_eval.json").write_text(json.dumps({
                "step": 100, "eval_batches": len(vals), "micro_batch": 4, "seq": 256, "whole_split": whole,
                "val_loss": float(np.mean(vals)), "val_batch_losses": vals}))
            (base if name == "bf16" else cand).append(str(r))
    return base, cand


def test_t_quantiles_and_interval() -> None:
    assert t975(1) == 12.706 and t975(3) == 3.182 and abs(t975(60) - 2.000) < 0.003
    mean, low, high = t_interval([0.001, 0.003, 0.002, 0.004])
    sd = np.std([0.001, 0.003, 0.002, 0.004], ddof=1)
    assert mean == pytest.approx(0.0025) and high - mean == pytest.approx(3.182 * sd / 2) == mean - low
    with pytest.raises(ValueError):
        t_interval([0.1])


@pytest.mark.parametrize("gaps,verdict,code", [([0.002, 0.003, 0.001, 0.004], "pass", 0),
                                               ([0.03, 0.032, 0.029, 0.031], "fail", 1),
                                               ([0.0, 0.012, 0.004, 0.010], "inconclusive", 3)])
def test_seed_set_verdicts_follow_the_t_interval(tmp_path: Path, gaps: list[float], verdict: str,
                                                 code: int) -> None:
    base, cand = _set(tmp_path, gaps, bf16_offsets=[0.0, 0.002, -0.001, 0.001])
    r = run("--baselines", *base, "--candidates", *cand, "--out", str(tmp_path / "rep"))
    assert r.returncode == code, r.stdout + r.stderr
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["verdict"] == verdict and len(rep["pairs"]) == 4
    assert rep["mean"] == pytest.approx(np.mean(gaps), abs=1e-9)
    assert [p["seed"] for p in rep["pairs"]] == [0, 1, 2, 3]
    assert all(p["source"] == "final_eval.json (whole split)" for p in rep["pairs"])
    assert rep["bf16_spread"] == pytest.approx((1.002 - 0.999) / 0.999, rel=1e-6)
    if verdict == "inconclusive":
        assert rep["seeds_needed"] and f"~{rep['seeds_needed']} seeds would decide it" in r.stdout
    assert (tmp_path / "rep" / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_pairs_are_made_by_seed_not_by_order(tmp_path: Path) -> None:
    base, cand = _set(tmp_path, [0.002, 0.004, 0.003])
    r = run("--baselines", *base, "--candidates", *reversed(cand), "--out", str(tmp_path / "rep"))
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert r.returncode == 0 and [round(p["gap"], 6) for p in rep["pairs"]] == [0.002, 0.004, 0.003]


def test_seed_sets_that_cannot_be_judged_are_refused(tmp_path: Path) -> None:
    base, cand = _set(tmp_path / "a", [0.002, 0.004, 0.003])
    r = run("--baselines", *base, "--candidates", *cand[:2])
    assert r.returncode == 2 and "seeds [2] have no partner" in r.stderr, r.stderr
    r = run("--baselines", base[0], "--candidates", cand[0])
    assert r.returncode == 2 and "at least two seeds" in r.stderr
    other, _ = _set(tmp_path / "b", [0.0, 0.0], protocol={**PROTOCOL, "name": "v2"})
    r = run("--baselines", base[0], other[1], "--candidates", *cand[:2])
    assert r.returncode == 2 and "differ in protocol" in r.stderr, r.stderr
    partial, pc = _set(tmp_path / "c", [0.002, 0.004], whole=False)
    r = run("--baselines", *partial, "--candidates", *pc)
    assert r.returncode == 2 and "whole-split final evaluation" in r.stderr, r.stderr
    r = run(base[0], cand[0], "--baselines", *base, "--candidates", *cand)
    assert r.returncode == 2 and "not both" in r.stderr


def _set_precision(run_dir: str, precision: dict) -> None:
    path = Path(run_dir) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["precision"] = precision
    path.write_text(json.dumps(cfg))


def test_a_precision_section_recorded_before_a_schema_field_existed_is_the_same_precision(tmp_path: Path) -> None:
    """A run kept before ``precision.base`` existed records no ``base``; a newer run of the same recipe records its
    default. Both are one precision (the set is judged); a real difference in the recipe is still refused."""
    from ds_nvfp4.config.schema import PrecisionConfig

    base, cand = _set(tmp_path, [0.002, 0.004, 0.003])
    newer = PrecisionConfig(enabled=True).model_dump(mode="json")
    older = {k: v for k, v in newer.items() if k != "base"}
    _set_precision(cand[0], older)
    _set_precision(cand[1], newer)
    r = run("--baselines", *base, "--candidates", *cand, "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    _set_precision(cand[2], {**newer, "modules": {**newer["modules"], "keep_last_blocks_bf16": 2}})
    r = run("--baselines", *base, "--candidates", *cand)
    assert r.returncode == 2 and "differ in precision" in r.stderr, r.stderr


def test_each_pair_names_its_machine_and_a_set_spanning_machine_types_says_so(tmp_path: Path) -> None:
    """Pairs are same-machine differences; a set whose pairs ran on different CPUs is judged, and its report names
    each pair's machine and warns that the BF16 spread mixes machines."""
    from tests.evaluation.test_compare import MACHINE

    base, cand = _set(tmp_path, [0.002, 0.004, 0.003])
    r = run("--baselines", *base, "--candidates", *cand, "--out", str(tmp_path / "one"))
    rep = json.loads((tmp_path / "one" / "report.json").read_text())
    xeon = f"{MACHINE['name']} ({MACHINE['bf16_gemm']})"
    assert r.returncode == 0 and [p["machine"] for p in rep["pairs"]] == [xeon] * 3
    assert not any("machine types" in n for n in rep["notes"])
    epyc = {"device": "cpu", "name": "AMD EPYC", "bf16_gemm": "CPU with AVX512-BF16"}
    for d in (base[2], cand[2]):
        cfg = json.loads((Path(d) / "config.json").read_text())
        (Path(d) / "config.json").write_text(json.dumps({**cfg, "machine": epyc}))
    r = run("--baselines", *base, "--candidates", *cand, "--out", str(tmp_path / "two"))
    rep = json.loads((tmp_path / "two" / "report.json").read_text())
    assert r.returncode == 0 and rep["pairs"][2]["machine"] == "AMD EPYC (CPU with AVX512-BF16)"
    assert any("2 machine types" in n and "BF16 seed spread mixes machines" in n for n in rep["notes"])
    assert "| AMD EPYC (CPU with AVX512-BF16) |" in (tmp_path / "two" / "report.md").read_text()


def test_seeds_needed_shrinks_the_interval_past_the_threshold() -> None:
    n = seeds_needed(0.005, 0.004, 0.01, 4)
    assert n is not None and t975(n - 1) * 0.004 / n ** 0.5 < 0.005 <= t975(n - 2) * 0.004 / (n - 1) ** 0.5
    assert seeds_needed(0.01, 0.004, 0.01, 4) is None


KEPT = sorted((Path(__file__).resolve().parents[2] / "docs" / "evidence").rglob("seedset_*/report.json"))


@pytest.mark.parametrize("report", KEPT, ids=lambda p: str(p.parent.relative_to(p.parents[3])))
def test_every_kept_seed_set_reproduces_from_the_kept_runs(report: Path) -> None:
    """Each seed-set verdict in docs/evidence is re-judged from the runs kept beside it (metrics and summary
    gzipped, as bench/keep_evidence.sh keeps them): the same pairs, gaps, interval and verdict."""
    from ds_nvfp4.evaluation.seedset import compare_seed_sets

    kept = json.loads(report.read_text())
    root = report.parents[1]  # the report names each run by the path it was given; the run is kept beside it
    again = compare_seed_sets([str(root / Path(p["baseline"]).name) for p in kept["pairs"]],
                              [str(root / Path(p["candidate"]).name) for p in kept["pairs"]])
    assert again.verdict == kept["verdict"]
    assert [p.gap for p in again.pairs] == pytest.approx([p["gap"] for p in kept["pairs"]], abs=1e-12)
    assert (again.mean, *again.ci) == pytest.approx((kept["mean"], *kept["ci"]), abs=1e-12)
