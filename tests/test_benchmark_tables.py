"""Every table of docs/benchmarks.md is what bench/tables.py generates from its kept raw output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_tables_match_their_kept_output() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "tables.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_interleaved_timing_runs_every_row_once_per_round_and_keeps_each_rounds_ratio(tmp_path: Path) -> None:
    """bench/_timing.py: rows timed in rounds (the order rotated, so no row always runs first after the previous
    round's), and each round's ratio to the baseline's call in that round kept beside the ratio of the medians."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import _timing
    finally:
        sys.path.remove(str(ROOT / "bench"))
    order: list[str] = []
    fns = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
    times = _timing.interleaved(fns, repeats=3, warmup=1)
    warmups, rounds = order[:3], order[3:]
    assert warmups == ["a", "b", "c"] and rounds == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [len(v) for v in times.values()] == [3, 3, 3]
    rows = {"base": [1.0, 2.0, 4.0], "x": [1.5, 2.2, 6.0]}
    out = _timing.report(rows, "base", "h", "vs base", str(tmp_path / "t.json"), "ratio", interleaved=True)
    assert out["rows"]["x"]["round_ratios"] == [1.5, 1.1, 1.5]
    # the process's peak resident memory (MiB), read before the allocator probe: the allocator_memory table's column
    import resource
    # (kept to 0.1 MiB, so it may round up past the exact peak by 0.05)
    assert 0 < out["max_rss_mib"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + 0.05
    assert out["rows"]["x"]["ratio"] == 2.2 / 2.0
    assert "round_ratios" not in _timing.report(rows, "base", "h", "vs base", None, "ratio")["rows"]["x"]
