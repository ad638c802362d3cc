"""The evidence still owed, and which of it this machine can run: read from what docs/evidence keeps.

Sessions land on machines of several CPU types, and a seed pair's two runs must share one (their BF16 GEMMs round
differently from the first step: bench/same_bits.py). This reads every seed set kept under ``--evidence``
(``<model>/seedset_*/report.json``, written by ``ds-nvfp4 compare --baselines ... --candidates ...``) and the
runs beside it, and lists:

* **unpaired halves**: a kept ``bf16_seedN`` of a set's seeds without its candidate ``<recipe>_seedN``, or the
  other way round; the missing run must run on the machine type of the kept one;
* **undecided sets**: a set judged ``inconclusive`` owes pairs up to its ``seeds_needed`` estimate, every new pair
  on the set's machine type (a set whose pairs span types says so in its report);
* **started recipes**: a recipe with kept runs and no BF16 seed set yet (its first pair kept, or half of it) owes
  the other halves and a second pair, on its runs' machine type: two pairs are the least a set is judged on (a kept
  BF16 run of a new seed is that pair's twin);
* **planned runs**: the runs named in a model folder's ``planned.txt`` (one set's run names, written when the set
  is started, ``#`` comments) and not kept yet, on the machine type of the folder's kept runs: a set whose first
  run is kept and whose recipe has no kept run yet is not forgotten between sessions.

Beside the seed sets, **planned benchmarks**: the entries of ``--bench``'s ``planned.txt`` (docs/evidence/bench) whose
output file is not kept yet, each owed on CPUs of the BF16 GEMM units its ``units:`` line names (a benchmark's
speed depends on the units, not on the CPU model), printed with its command where this machine has them.

For each owed run it says whether this machine is of the required type and, where it is, prints the commands that
copy the kept twin into a runs folder and train the run with bench/evidence.sh; a run of that folder stopped
before it finished (a session's end) with a checkpoint is named with the step the command resumes it from, or, if
it started on another machine type, as one to delete (launch/train.py refuses to resume it). A set whose newest
report says pass or fail owes no new pairs (only the other halves of kept runs: every set is meant to reach 4
pairs); a set superseded by a larger one of the same recipe is not read.

    python bench/pending.py                   # every set under docs/evidence/v3
    python bench/pending.py --json pending.json

A benchmark ``planned.txt``::

    # issue 35 item 7: the AMX targets with freed buffers reused
    units: CPU with AMX-BF16
    gemm_amx_reuse.json: MALLOC_MMAP_MAX_=0 python bench/gemm.py --json docs/evidence/bench/gemm_amx_reuse.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from itertools import count, islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ds_nvfp4.evaluation.seedset import machine_label  # noqa: E402

SEED = re.compile(r"^(?P<recipe>.+)_seed(?P<seed>\d+)$")


@dataclass(frozen=True)
class Owed:
    """One run a kept seed set still needs: its folder, the set it completes, why, and the machine type it needs."""

    folder: str         # the model's folder under --evidence
    model: str          # bench/evidence.sh's MODEL (the kept runs' config.json: args.model)
    run: str            # e.g. "nvfp4_zero3_seed3"
    twin: str | None    # the kept half it is paired with (copied into the runs folder first), or None
    set_report: str     # the seed set's report.json it answers, relative to the evidence folder
    why: str
    machine: str        # "CPU model (BF16 GEMM units)" as config.json records it
    here: bool          # this machine is of that type


def _model_name(config: dict, folder: str) -> str:
    """bench/evidence.sh's MODEL of a kept run (its config.json's ``args.model``), else the folder's name."""
    args = config.get("args")
    return str(args.get("model")) if isinstance(args, dict) and args.get("model") else folder


def _name(run: str) -> str:
    """A report's run name without the folder it was compared in ("p3_moe5m/bf16_seed0" -> "bf16_seed0")."""
    return Path(run).name


def _sets(model_dir: Path) -> dict[str, Path]:
    """The newest (most pairs) BF16-baselined seed-set report of each candidate recipe in one model's folder."""
    best: dict[str, tuple[int, Path]] = {}
    for report in sorted(model_dir.glob("seedset_*/report.json")):
        pairs = json.loads(report.read_text())["pairs"]
        if not pairs or not all(_name(p["baseline"]).startswith("bf16_seed") for p in pairs):
            continue  # e.g. a recipe against another recipe: no BF16 twins to complete
        recipe = SEED.match(_name(pairs[0]["candidate"]))["recipe"]
        if recipe not in best or len(pairs) > best[recipe][0]:
            best[recipe] = (len(pairs), report)
    return {recipe: report for recipe, (_, report) in best.items()}


def _started(model_dir: Path, model: str, runs: dict[str, dict], judged: set[str], here: str) -> list[Owed]:
    """The runs owed by each recipe with kept runs in ``model_dir`` and no BF16 seed set (not in ``judged``): the BF16
    half of each kept seed, then new seeds up to two pairs, all on the machine type of the recipe's kept runs."""
    owed: list[Owed] = []
    seeds_of: dict[str, list[int]] = {}
    for n in sorted(runs):
        if (m := SEED.match(n)) and m["recipe"] != "bf16" and m["recipe"] not in judged:
            seeds_of.setdefault(m["recipe"], []).append(int(m["seed"]))
    bf16 = {int(m["seed"]) for n in runs if (m := SEED.match(n)) and m["recipe"] == "bf16"}
    for recipe, seeds in sorted(seeds_of.items()):
        machine = machine_label(runs[f"{recipe}_seed{min(seeds)}"])
        where = f"{model_dir.name}/{recipe}_seed*: no seed set yet"
        for seed in sorted(seeds):
            if seed not in bf16:
                owed.append(Owed(model_dir.name, model, f"bf16_seed{seed}", f"{recipe}_seed{seed}", where,
                                 f"the other half of the kept {recipe}_seed{seed}", machine, machine == here))
        # new seeds: kept BF16 runs of this machine type first (their twin is kept), then unused seeds
        twins = [s for s in sorted(bf16) if s not in seeds and machine_label(runs[f"bf16_seed{s}"]) == machine]
        fresh = (s for s in count() if s not in seeds and s not in bf16)
        for seed in islice(iter(twins + list(islice(fresh, 2))), max(0, 2 - len(seeds))):
            why = f"a second pair: {recipe} has {len(seeds)} kept and 2 pairs are the least a set is judged on"
            if seed in bf16:
                owed.append(Owed(model_dir.name, model, f"{recipe}_seed{seed}", f"bf16_seed{seed}", where, why,
                                 machine, machine == here))
            else:
                owed += [Owed(model_dir.name, model, run, None, where, why, machine, machine == here)
                         for run in (f"bf16_seed{seed}", f"{recipe}_seed{seed}")]
    return owed


def _planned(model_dir: Path, model: str, runs: dict[str, dict], listed: set[str], here: str) -> list[Owed]:
    """The runs of ``model_dir/planned.txt`` neither kept nor owed already (``listed``), in the file's order, on the
    machine type of the folder's kept runs or of the file's ``machine: <label>`` line (``machine_label``'s form,
    e.g. ``machine: AMD EPYC (CPU with AVX512-BF16)``), which holds a set to its type before its first run is kept
    (the twin of a ``<recipe>_seedN`` is a kept ``bf16_seedN``, and the other way round)."""
    plan = model_dir / "planned.txt"
    if not plan.exists():
        return []
    lines = [line.split("#", 1)[0].strip() for line in plan.read_text().splitlines()]
    pinned = [line.split(":", 1)[1].strip() for line in lines if line.startswith("machine:")]
    names = [n for line in lines if not line.startswith("machine:") for n in line.split()]
    bad = [n for n in names if not SEED.match(n)]
    if bad:
        raise SystemExit(f"{plan}: {', '.join(bad)}: a planned run is named <recipe>_seed<N> (e.g. bf16_seed0)")
    types = sorted({machine_label(c) for c in runs.values()} | set(pinned))
    if len(types) > 1:
        raise SystemExit(f"{plan}: the kept runs beside it and its machine: line span {' / '.join(types)}: "
                         "a set's pairs need one type")
    # nothing kept and no "machine:" line: any machine may start the set
    machine = types[0] if types else here
    owed = []
    for name in names:
        if name in runs or name in listed:
            continue
        m = SEED.match(name)
        if m["recipe"] == "bf16":  # a BF16 run is the twin of the kept recipe run of its seed, if any
            twin = next((t for t in sorted(runs)
                         if (k := SEED.match(t)) and k["seed"] == m["seed"] and k["recipe"] != "bf16"), None)
        else:
            twin = f"bf16_seed{m['seed']}" if f"bf16_seed{m['seed']}" in runs else None
        owed.append(Owed(model_dir.name, model, name, twin, f"{model_dir.name}/planned.txt",
                         "planned when the set was started", machine, machine == here))
    return owed


def pending(evidence: Path, here: str) -> tuple[list[Owed], list[str]]:
    """Every run the seed sets under ``evidence`` owe, in model, set and seed order; and the inconclusive sets that
    no number of seeds of their recipe would decide (the mean on the threshold): they need another recipe."""
    owed: list[Owed] = []
    stuck: list[str] = []
    if not evidence.is_dir():
        raise SystemExit(f"{evidence}: no such folder (--evidence: the kept seed sets, one subfolder per model)")
    for model_dir in sorted(p for p in evidence.iterdir() if p.is_dir()):
        runs = {p.name: json.loads((p / "config.json").read_text())
                for p in model_dir.iterdir() if (p / "config.json").exists()}
        model = _model_name(next(iter(runs.values())), model_dir.name) if runs else model_dir.name
        sets = _sets(model_dir)
        for recipe, report_path in sorted(sets.items()):
            report = json.loads(report_path.read_text())
            where = str(report_path.relative_to(evidence))
            seeds = sorted(int(SEED.match(_name(p["candidate"]))["seed"]) for p in report["pairs"])
            machines = sorted({machine_label(runs[_name(p["baseline"])]) for p in report["pairs"]
                               if _name(p["baseline"]) in runs})
            # unpaired halves: a seed whose one run is kept and whose other is not
            kept_seeds = {int(m["seed"]) for n in runs if (m := SEED.match(n)) and m["recipe"] in ("bf16", recipe)}
            for seed in sorted(kept_seeds - set(seeds)):
                base, cand = f"bf16_seed{seed}", f"{recipe}_seed{seed}"
                have, missing = (base, cand) if base in runs else (cand, base)
                if missing in runs:
                    continue  # both kept, not yet compared: `ds-nvfp4 compare` owes, not a training run
                m = machine_label(runs[have])
                owed.append(Owed(model_dir.name, model, missing, have, where, f"the other half of the kept {have}",
                                 m, m == here))
            if report["verdict"] != "inconclusive":
                continue
            if not report.get("seeds_needed"):
                stuck.append(f"{where}: inconclusive on {len(seeds)} pairs with its mean {report['mean']:+.3%} on "
                             f"the {report['threshold']:.0%} threshold: at this mean no number of seeds decides it; "
                             "another recipe may")
                continue
            taken = set(seeds) | kept_seeds  # a kept half's seed is a pair on its way
            new = islice((s for s in count() if s not in taken), max(0, report["seeds_needed"] - len(taken)))
            m = machines[0] if len(machines) == 1 else " / ".join(machines)
            why = (f"the set is inconclusive on {len(seeds)} pairs (mean {report['mean']:+.3%}, 95% "
                   f"{report['ci'][0]:+.3%} .. {report['ci'][1]:+.3%}); about {report['seeds_needed']} would decide")
            for seed in new:
                for run in (f"bf16_seed{seed}", f"{recipe}_seed{seed}"):
                    owed.append(Owed(model_dir.name, model, run, None, where, why, m, m == here))
        owed += _started(model_dir, model, runs, set(sets), here)
        owed += _planned(model_dir, model, runs, {o.run for o in owed if o.folder == model_dir.name}, here)
    return owed, stuck


@dataclass(frozen=True)
class OwedBench:
    """One planned benchmark whose output file is not kept yet: the file, why, the units it needs, its command."""

    output: str         # the file it writes, relative to the bench folder (e.g. "gemm_amx_reuse.json")
    why: str            # the comment lines above its entry, joined
    units: str          # "CPU with AMX-BF16", as machine()["bf16_gemm"] says it
    command: str
    here: bool          # this machine has those units


def pending_benchmarks(bench_dir: Path, here_units: str) -> list[OwedBench]:
    """The entries ``OUTPUT: COMMAND`` of ``bench_dir/planned.txt`` whose OUTPUT is not in ``bench_dir``, each under
    the ``units: <BF16 GEMM units>`` line above it; ``#`` lines above an entry say why it is owed."""
    plan = bench_dir / "planned.txt"
    if not plan.exists():
        return []
    owed: list[OwedBench] = []
    units: str | None = None
    why: list[str] = []
    for n, raw in enumerate(plan.read_text().splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            why.append(line.lstrip("# "))
            continue
        key, sep, rest = line.partition(":")
        if not sep or not rest.strip():
            raise SystemExit(f"{plan}:{n}: expected 'units: <BF16 GEMM units>' or 'OUTPUT: COMMAND', got {line!r}")
        if key.strip() == "units":
            units = rest.strip()
            continue
        if units is None:
            raise SystemExit(f"{plan}:{n}: {key.strip()}: no 'units:' line above it (e.g. units: CPU with AMX-BF16)")
        if not (bench_dir / key.strip()).exists():
            owed.append(OwedBench(key.strip(), " ".join(why), units, rest.strip(), units == here_units))
        why = []
    return owed


def interrupted(run: Path, here: str) -> list[str]:
    """What an interrupted run left in ``run`` (a runs folder of this working tree, not docs/evidence): nothing, or
    the step bench/evidence.sh resumes it from (``ckpt/latest``, saved every CKPT steps), or, when its config.json
    says it started on another machine type, that launch/train.py refuses to resume it and what to do."""
    latest = run / "ckpt" / "latest"
    if not latest.exists() or (run / "summary.json").exists():
        return []
    cfg, tag = run / "config.json", latest.read_text().strip()
    started = machine_label(json.loads(cfg.read_text())) if cfg.exists() else here
    if started != here:
        return [f"{run}: stopped at {tag} on {started}; launch/train.py refuses to resume it here (another machine "
                f"type): delete {run} to train it afresh"]
    return [f"{run}: its newest checkpoint is {tag} and it has not finished: unless it is training now, the command "
            "below resumes it from there"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--evidence", type=Path, default=ROOT / "docs" / "evidence" / "v3",
                   help="the folder of kept seed sets, one subfolder per model (default: docs/evidence/v3)")
    p.add_argument("--bench", type=Path, default=ROOT / "docs" / "evidence" / "bench",
                   help="the folder of kept benchmark output and its planned.txt (default: docs/evidence/bench)")
    p.add_argument("--runs", type=Path, default=Path("runs"),
                   help="where the printed commands train (runs/pending_<folder>), and where a run interrupted "
                        "before (its newest checkpoint kept) is found to be resumed (default: runs)")
    p.add_argument("--json", default=None, help="also write the owed runs here")
    args = p.parse_args()
    from ds_nvfp4.envcheck import machine

    this = machine()
    here = machine_label({"machine": this})
    owed, stuck = pending(args.evidence, here)
    benches = pending_benchmarks(args.bench, this["bf16_gemm"])
    print(f"this machine: {here}")
    for b in benches:
        print(f"  {'HERE ' if b.here else 'other'}   bench  {b.output:<24} on a {b.units}: {b.why}")
    if not owed:
        print("no kept seed set owes a run")
    for line in stuck:
        print(f"  undecidable by seeds: {line}")
    for o in owed:
        print(f"  {'HERE ' if o.here else 'other'}  {o.model:>6}  {o.run:<24} on {o.machine}: {o.why} ({o.set_report})")
    by_folder: dict[str, list[Owed]] = {}
    for o in owed:
        if o.here:
            by_folder.setdefault(o.folder, []).append(o)
    for folder, runs in by_folder.items():
        out = f"{args.runs}/pending_{folder}"
        print(f"\nto run here ({folder}), then keep each run (bench/keep_evidence.sh) and compare the set again:")
        for line in (line for o in runs for line in interrupted(Path(out) / o.run, here)):
            print(f"  ({line})")
        print(f"  mkdir -p {out}")
        for twin in dict.fromkeys(o.twin for o in runs if o.twin is not None):  # one copy per kept twin
            kept = (args.evidence / folder / twin).resolve()
            print(f"  cp -r {kept.relative_to(ROOT) if kept.is_relative_to(ROOT) else kept} {out}/ && "
                  f"gunzip -f {out}/{twin}/*.gz")
        print(f"  PROTOCOL=v3 MODEL={runs[0].model} OUT={out} RUNS=\"{' '.join(o.run for o in runs)}\" "
              "PROBE_RUNS= bash bench/evidence.sh")
    if any(b.here for b in benches):
        print("\nbenchmarks to run here (with the machine otherwise idle: training paused), then commit each output:")
        for b in benches:
            if b.here:
                print(f"  {b.command}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": here, "owed": [asdict(o) for o in owed],
                                               "undecidable": stuck, "benchmarks": [asdict(b) for b in benches]},
                                              indent=1))


if __name__ == "__main__":
    main()
