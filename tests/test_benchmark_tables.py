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
