"""bench/pending.py: the runs kept seed sets still owe, read from a real evidence tree (config.json, report.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.pending import pending
from ds_nvfp4.envcheck import machine
from ds_nvfp4.evaluation.seedset import machine_label

ROOT = Path(__file__).resolve().parents[1]
XEON = {"device": "cpu", "name": "Intel(R) Xeon(R) Processor", "bf16_gemm": "CPU with AMX-BF16"}


def _run(folder: Path, name: str, where: dict) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "config.json").write_text(json.dumps({"args": {"model": "moe-5m"}, "machine": where}))


def _set(folder: Path, name: str, recipe: str, seeds: list[int], verdict: str, needed: int | None,
         baseline: str = "bf16") -> None:
    pairs = [{"seed": s, "baseline": f"runs/x/{baseline}_seed{s}", "candidate": f"{recipe}_seed{s}"} for s in seeds]
    (folder / name).mkdir()
    (folder / name / "report.json").write_text(json.dumps({
        "verdict": verdict, "pairs": pairs, "threshold": 0.01, "mean": 0.008, "ci": [0.004, 0.012],
        "seeds_needed": needed}))


def _tree(tmp: Path, where: dict) -> Path:
    ev = tmp / "v3"
    m = ev / "moe5m"
    for s in range(4):
        _run(m, f"bf16_seed{s}", where)
    for s in range(3):
        _run(m, f"nvfp4_zero3_seed{s}", where)
        _run(m, f"late15_seed{s}", where)
    _set(m, "seedset_w_2", "nvfp4_zero3", [0, 1], "inconclusive", 9)  # superseded by seedset_3 (listed after it)
    _set(m, "seedset_3", "nvfp4_zero3", [0, 1, 2], "inconclusive", 5)
    # decided, yet the kept bf16_seed3 owes its late15 half (as 10M's fourth pair does: >= 4 pairs per set)
    _set(m, "seedset_late15_3", "late15", [0, 1, 2], "pass", None)
    _set(m, "seedset_vs", "late15", [0, 1, 2], "inconclusive", 7, baseline="nvfp4_zero3")  # no BF16 twins
    o = ev / "other"
    for s in range(2):
        _run(o, f"bf16_seed{s}", where)
        _run(o, f"nvfp4_zero3_seed{s}", where)
    _set(o, "seedset_2", "nvfp4_zero3", [0, 1], "inconclusive", None)
    return ev


def test_owed_runs_unpaired_halves_and_undecided_sets(tmp_path: Path) -> None:
    ev = _tree(tmp_path, XEON)
    owed, stuck = pending(ev, here=machine_label({"machine": XEON}))
    got = [(o.folder, o.run, o.twin, o.set_report) for o in owed]
    assert got == [("moe5m", "late15_seed3", "bf16_seed3", "moe5m/seedset_late15_3/report.json"),
                   ("moe5m", "nvfp4_zero3_seed3", "bf16_seed3", "moe5m/seedset_3/report.json"),
                   ("moe5m", "bf16_seed4", None, "moe5m/seedset_3/report.json"),
                   ("moe5m", "nvfp4_zero3_seed4", None, "moe5m/seedset_3/report.json")], got
    assert all(o.here and o.model == "moe-5m" and o.machine == "Intel(R) Xeon(R) Processor (CPU with AMX-BF16)"
               for o in owed)
    assert len(stuck) == 1 and stuck[0].startswith("other/seedset_2/report.json: inconclusive on 2 pairs"), stuck
    assert not any(o.here for o in pending(ev, here="AMD EPYC (CPU with AVX512-BF16)")[0])


def test_the_command_line_prints_what_to_run_on_this_machine(tmp_path: Path) -> None:
    ev = _tree(tmp_path, machine())  # the kept runs made on this machine's type
    r = subprocess.run([sys.executable, "bench/pending.py", "--evidence", str(ev), "--json", str(tmp_path / "p.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "newest checkpoint" not in r.stdout and "\n\n\n" not in r.stdout, r.stdout
    assert r.stdout.count(f"cp -r {ev / 'moe5m' / 'bf16_seed3'} runs/pending_moe5m/") == 1, r.stdout
    assert ('PROTOCOL=v3 MODEL=moe-5m OUT=runs/pending_moe5m RUNS="late15_seed3 nvfp4_zero3_seed3 bf16_seed4 '
            'nvfp4_zero3_seed4"'
            in r.stdout), r.stdout
    kept = json.loads((tmp_path / "p.json").read_text())
    assert len(kept["owed"]) == 4 and len(kept["undecidable"]) == 1


def test_a_recipe_whose_first_pair_is_kept_owes_its_second(tmp_path: Path) -> None:
    """No seed set yet: the kept halves' twins, then a second pair (a kept BF16 run of a new seed is its twin)."""
    epyc = {"device": "cpu", "name": "AMD EPYC", "bf16_gemm": "CPU with AVX512-BF16"}
    ev = tmp_path / "v3"
    a, b = ev / "moe5m_a", ev / "moe5m_b"
    for name in ("bf16_seed0", "moe_last2_seed0", "bf16_seed1"):
        _run(a, name, epyc)
    _run(a, "bf16_seed2", XEON)  # another machine type: not a twin
    _run(b, "moe_last2_seed0", epyc)
    owed, _ = pending(ev, here=machine_label({"machine": epyc}))
    got = [(o.folder, o.run, o.twin) for o in owed]
    assert got == [("moe5m_a", "moe_last2_seed1", "bf16_seed1"),
                   ("moe5m_b", "bf16_seed0", "moe_last2_seed0"),
                   ("moe5m_b", "bf16_seed1", None), ("moe5m_b", "moe_last2_seed1", None)], got
    assert all(o.here and o.machine == "AMD EPYC (CPU with AVX512-BF16)" for o in owed)
    assert all(o.set_report.endswith("moe_last2_seed*: no seed set yet") for o in owed)


def test_a_planned_set_is_owed_from_its_first_kept_run(tmp_path: Path) -> None:
    """planned.txt: the set's runs, owed on the machine type of what is kept (here only a BF16 twin so far)."""
    epyc = {"device": "cpu", "name": "AMD EPYC", "bf16_gemm": "CPU with AVX512-BF16"}
    folder = tmp_path / "v3" / "moe5m_epyc"
    _run(folder, "bf16_seed0", epyc)
    (folder / "planned.txt").write_text("# the moe_last2 candidate (issue 35)\nbf16_seed0 moe_last2_seed0\n"
                                        "bf16_seed1 moe_last2_seed1\n")
    owed, _ = pending(tmp_path / "v3", here=machine_label({"machine": XEON}))
    assert [(o.run, o.twin) for o in owed] == [("moe_last2_seed0", "bf16_seed0"), ("bf16_seed1", None),
                                               ("moe_last2_seed1", None)], owed
    assert all(o.set_report == "moe5m_epyc/planned.txt" and not o.here
               and o.machine == "AMD EPYC (CPU with AVX512-BF16)" for o in owed)
    _run(folder, "moe_last2_seed0", epyc)  # the first pair kept: the started-recipe rule owes the same, once
    owed, _ = pending(tmp_path / "v3", here=machine_label({"machine": epyc}))
    assert [(o.run, o.twin) for o in owed] == [("bf16_seed1", None), ("moe_last2_seed1", None)], owed
    (folder / "planned.txt").write_text("moe_last2\n")
    with pytest.raises(SystemExit, match="moe_last2: a planned run is named <recipe>_seed<N>"):
        pending(tmp_path / "v3", here="x")


def test_a_planned_set_pinned_to_a_machine_type_before_anything_is_kept(tmp_path: Path) -> None:
    """planned.txt's ``machine:`` line: a set started on one type is not owed on another before its first run is
    kept, and a kept run of another type is refused."""
    epyc = {"device": "cpu", "name": "AMD EPYC", "bf16_gemm": "CPU with AVX512-BF16"}
    folder = tmp_path / "v3" / "10m_epyc"
    folder.mkdir(parents=True)
    (folder / "planned.txt").write_text("machine: AMD EPYC (CPU with AVX512-BF16)  # the type it started on\n"
                                        "bf16_seed0 nvfp4_zero3_seed0\n")
    owed, _ = pending(tmp_path / "v3", here=machine_label({"machine": XEON}))
    assert [(o.run, o.here, o.machine) for o in owed] == [
        ("bf16_seed0", False, "AMD EPYC (CPU with AVX512-BF16)"),
        ("nvfp4_zero3_seed0", False, "AMD EPYC (CPU with AVX512-BF16)")], owed
    owed, _ = pending(tmp_path / "v3", here=machine_label({"machine": epyc}))
    assert all(o.here for o in owed) and len(owed) == 2, owed
    _run(folder, "bf16_seed0", XEON)
    with pytest.raises(SystemExit, match=r"span AMD EPYC .* / Intel"):
        pending(tmp_path / "v3", here="x")


def test_planned_benchmarks_are_owed_on_their_units_until_their_output_is_kept(tmp_path: Path) -> None:
    """docs/evidence/bench/planned.txt: an entry is owed until its output file is kept, on CPUs of its units."""
    from bench.pending import pending_benchmarks

    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "planned.txt").write_text(
        "# the AMX targets\n# with buffers reused\nunits: CPU with AMX-BF16\n"
        "a.json: python bench/gemm.py --json docs/evidence/bench/a.json\n"
        "b.json: python bench/experts.py --json docs/evidence/bench/b.json\n"
        "units: CPU with AVX512-BF16\nc.json: python bench/quantize.py --json docs/evidence/bench/c.json\n")
    (bench / "b.json").write_text("{}")  # kept: no longer owed
    owed = pending_benchmarks(bench, "CPU with AMX-BF16")
    assert [(b.output, b.units, b.here) for b in owed] == [("a.json", "CPU with AMX-BF16", True),
                                                           ("c.json", "CPU with AVX512-BF16", False)], owed
    assert owed[0].why == "the AMX targets with buffers reused" and owed[0].command.startswith("python bench/gemm.py")
    (bench / "planned.txt").write_text("a.json: python bench/gemm.py\n")
    with pytest.raises(SystemExit, match=r"a\.json: no 'units:' line above it"):
        pending_benchmarks(bench, "x")
    with pytest.raises(SystemExit, match="none: no such folder"):
        pending(tmp_path / "none", here="x")
    # the command line prints the owed benchmark's command on a machine with its units, and not elsewhere
    units = machine()["bf16_gemm"]
    (bench / "planned.txt").write_text(f"units: {units}\nd.json: python bench/gemm.py --json d.json\n"
                                       "units: no such units\ne.json: python bench/experts.py --json e.json\n")
    (tmp_path / "v3").mkdir()
    r = subprocess.run([sys.executable, "bench/pending.py", "--evidence", str(tmp_path / "v3"), "--bench",
                        str(bench)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "\n  python bench/gemm.py --json d.json" in r.stdout, r.stdout
    assert "  python bench/experts.py" not in r.stdout, r.stdout


def test_an_interrupted_run_of_this_working_tree_is_said_to_resume_or_not(tmp_path: Path) -> None:
    """A run stopped with a checkpoint (a session's end) resumes from it when the tree survives; one started on
    another machine type is not resumable here (launch/train.py refuses it) and the line says what to do."""
    ev = _tree(tmp_path, machine())
    out = tmp_path / "runs" / "pending_moe5m"
    for run, where, done in (("late15_seed3", machine(), False), ("nvfp4_zero3_seed3", XEON, False),
                             ("bf16_seed4", machine(), True), ("nvfp4_zero3_seed4", machine(), None)):
        (out / run / "ckpt").mkdir(parents=True)
        if done is None:
            continue  # a folder without a checkpoint: nothing to resume
        (out / run / "ckpt" / "latest").write_text("step300")
        (out / run / "config.json").write_text(json.dumps({"machine": where}))
        if done:
            (out / run / "summary.json").write_text("{}")
    r = subprocess.run([sys.executable, "bench/pending.py", "--evidence", str(ev), "--runs", str(tmp_path / "runs")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "step300" in ln]
    if machine() == XEON:  # the other run is of this type here: both resumable
        pytest.skip("this machine is the test's other type")
    assert len(lines) == 2, r.stdout
    assert f"{out / 'late15_seed3'}: its newest checkpoint is step300 and it has not finished" in lines[0]
    assert (f"{out / 'nvfp4_zero3_seed3'}: stopped at step300 on Intel(R) Xeon(R) Processor (CPU with AMX-BF16); "
            "launch/train.py refuses" in lines[1] and f"delete {out / 'nvfp4_zero3_seed3'}" in lines[1]), lines
    assert f"OUT={tmp_path / 'runs'}/pending_moe5m RUNS=" in r.stdout
