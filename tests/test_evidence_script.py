"""bench/evidence.sh refuses to train one half of a seed pair on another machine type than the other half.

CPUs of different types run different BF16 GEMM kernels, whose rounding differs from the first step
(docs/evidence/v3/same_bits_2026-12-06_epyc.json), so a pair split across them is not the controlled comparison a
verdict assumes. The check runs before any training (``CHECK_ONLY=1`` stops right after it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OTHER = {"device": "cpu", "name": "Another CPU", "bf16_gemm": "CPU with AMX-BF16"}


def _kept(out: Path, name: str, machine: dict) -> None:
    (out / name).mkdir(parents=True)
    (out / name / "config.json").write_text(json.dumps({"args": {"seed": 3}, "machine": machine}))


def _check(out: Path, runs: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "bench" / "evidence.sh")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "BIN": str(Path(sys.executable).parent), "OUT": str(out),
                               "RUNS": runs, "CHECK_ONLY": "1", **env})


def test_a_pair_is_not_split_across_machine_types(tmp_path: Path) -> None:
    from ds_nvfp4.envcheck import machine

    _kept(tmp_path / "a", "bf16_seed3", OTHER)
    r = _check(tmp_path / "a", "nvfp4_zero3_seed3")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{tmp_path / 'a' / 'bf16_seed3'}, which ran on Another CPU (CPU with AMX-BF16)" in r.stderr
    assert not (tmp_path / "a" / "nvfp4_zero3_seed3").exists()  # refused before anything ran
    # the other direction: a BF16 seed whose NVFP4 twin ran elsewhere
    _kept(tmp_path / "b", "nvfp4_zero3_seed3", OTHER)
    r = _check(tmp_path / "b", "bf16_seed3")
    assert r.returncode == 2 and "nvfp4_zero3_seed3, which ran on Another CPU" in r.stderr, r.stderr
    # told to, it trains anyway (the report then says the machines differ)
    assert _check(tmp_path / "a", "nvfp4_zero3_seed3", ALLOW_OTHER_MACHINE="1").returncode == 0
    # a twin of this machine's type, and a run with no twin yet, pass
    _kept(tmp_path / "c", "bf16_seed3", machine())
    r = _check(tmp_path / "c", "nvfp4_zero3_seed3 nvfp4_zero3_seed4 bf16_seed4")
    assert r.returncode == 0 and "every pair of RUNS can run on this machine" in r.stdout, r.stdout + r.stderr
