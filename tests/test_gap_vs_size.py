"""bench/gap_vs_size.py draws seed sets (mean paired gap, t interval, each pair's gap) from the kept reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETS = [ROOT / "docs" / "evidence" / "v3" / "5m" / "seedset_4", ROOT / "docs" / "evidence" / "v3" / "10m" / "seedset_3"]


def test_seed_set_points_are_the_sets_verdicts_with_each_pair(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gap_vs_size
    finally:
        sys.path.remove(str(ROOT / "bench"))
    pts = gap_vs_size.points([str(d) for d in reversed(SETS)])
    assert [p["params"] for p in pts] == sorted(p["params"] for p in pts)  # by size, whatever the order given
    for p, d in zip(pts, SETS):
        rep = json.loads((d / "report.json").read_text())
        assert (p["gap"], p["ci"], p["verdict"]) == (rep["mean"], rep["ci"], rep["verdict"])
        assert p["pair_gaps"] == [q["gap"] for q in rep["pairs"]]
        assert p["steps"] == 1200 and p["tokens"] == 1200 * 256 * 32 * 2  # protocol v3's batch, 2 ranks
    gap_vs_size.plot(pts, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    single = gap_vs_size.points([str(ROOT / "docs" / "evidence" / "v3" / "5m" / "report_nvfp4_zero3_seed3")])
    assert "pair_gaps" not in single[0] and single[0]["gap"] == pytest.approx(
        json.loads((SETS[0] / "report.json").read_text())["pairs"][3]["gap"], abs=1e-12)
