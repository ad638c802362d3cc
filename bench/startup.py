"""What a fresh process pays for its first NVFP4 quantizations: this checkout against another (A/B).

Every training rank and every 2-rank test is a new process, and a kernel that goes through ``torch.compile``
there costs seconds per process and argument signature even with Inductor's on-disk cache warm. Each trial starts
``python -c SNIPPET`` once per arm (the arms alternate, so both see the same load): the snippet imports ds_nvfp4,
then times the storage quantizations a ZeRO-3 rank makes first (1x16 and 16x16, four shapes, bfloat16) and
counts the graphs Dynamo compiled. The parent keeps each trial's wall seconds, the child's CPU seconds and graphs.

    python bench/startup.py --baseline /path/to/other/checkout --trials 7 --json docs/evidence/bench/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._timing import context

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = """
import json, sys, time
import torch
from ds_nvfp4.format import quantize
t0 = time.perf_counter()
for shape in [(64, 256), (128, 512), (256, 256), (32, 1024)]:
    x = torch.randn(*shape).to(torch.bfloat16)
    quantize(x)
    quantize(x, block="16x16")
seconds = time.perf_counter() - t0
dynamo = sys.modules.get("torch._dynamo.utils")
graphs = dynamo.counters["stats"]["unique_graphs"] if dynamo is not None else 0
import ds_nvfp4
print(json.dumps({"seconds": seconds, "graphs": graphs, "package": ds_nvfp4.__file__}))
"""


def commit_of(checkout: Path) -> str:
    """The checkout's short commit (``+dirty`` with uncommitted changes): what the kept JSON names, not a path."""
    git = ["git", "-C", str(checkout)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return (head or "not a git checkout") + ("+dirty" if dirty else "")


def one(checkout: Path) -> dict:
    """One fresh process with ``checkout`` first on the path: its report plus its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=600,
                          cwd="/")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"the snippet failed with {checkout} on the path:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out.pop("package").startswith(str(checkout)):
        raise SystemExit(f"{checkout}: the child imported ds_nvfp4 from elsewhere")
    out["cpu_seconds"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="another checkout of ds-nvfp4 (e.g. a worktree)")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--json", help="write every trial and the medians here")
    args = ap.parse_args()
    arms = {"this checkout": ROOT, "baseline": args.baseline.resolve()}
    trials: dict[str, list[dict]] = {name: [] for name in arms}
    for t in tqdm(range(args.trials), desc="trials", unit="pair"):
        order = list(arms) if t % 2 == 0 else list(arms)[::-1]
        for name in order:
            trials[name].append(one(arms[name]))
    summary = {name: {key: statistics.median(r[key] for r in rows) for key in ("seconds", "cpu_seconds", "graphs")}
               for name, rows in trials.items()}
    for name, s in summary.items():
        print(f"{name:>14}: first quantizations {s['seconds']:.2f} s (median of {args.trials}), process CPU "
              f"{s['cpu_seconds']:.1f} s, Dynamo graphs {s['graphs']:.0f}  [{arms[name]}]")
    if args.json:
        payload = {**context(), "arms": {k: commit_of(v) for k, v in arms.items()}, "trials": trials,
                   "median": summary}
        payload["command"] = payload["command"].replace(str(args.baseline), "BASELINE_CHECKOUT")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
