"""Tokens/s and resident memory per rank of BF16, the mission recipe and the paper recipe, in one invocation.

Usage: python bench/recipes.py [--model 5m] [--steps 50] [--rounds 2] [--json out.json]
Runs launch/train.py (2 CPU ranks, ZeRO-3) for every recipe, round-robin (bf16, mission, paper, bf16, ...) so
that a change in machine load hits every recipe alike, and reports the median over rounds of each run's median
tokens/s (warm-up steps excluded by train.py), as a ratio to BF16 measured in the same invocation, with the peak
resident memory and the weight-partition bytes per rank. A preset's precision.schedule is removed (its BF16 warm-up
would fill a short run): the figures are those of the FP4 phase. Figures go to docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: "mission" is the FP4 path at its widest (every block FP4, the figure issue 13 set targets for); "default" the
#: shipped preset (edge blocks BF16)
RECIPES = {"bf16": "bf16_zero3.json", "mission": "nvfp4_zero3_all_blocks_ablation.json",
           "default": "nvfp4_zero3.json", "paper": "nvfp4_full_zero3.json"}


def fp4_phase_config(recipe: str, tmp: Path) -> Path:
    """The recipe's preset without its ``precision.schedule``: a 50-step benchmark of a preset with a 50-step BF16
    warm-up (the paper preset) would time BF16 GEMMs; this times the FP4 phase, which is what the preset runs for
    all but its first steps."""
    path = ROOT / "ds_configs" / RECIPES[recipe]
    cfg = json.loads(path.read_text())
    if cfg.get("precision", {}).pop("schedule", None) is None:
        return path
    out = tmp / f"fp4_phase_{RECIPES[recipe]}"
    out.write_text(json.dumps(cfg))
    return out


def run(recipe: str, model: str, steps: int, out: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port", str(port),
           str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(fp4_phase_config(recipe, out.parent)),
           "--model", model, "--steps", str(steps), "--eval-interval", str(steps), "--eval-batches", "2",
           "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, cwd=ROOT)
    if r.returncode != 0 or not (out / "summary.json").exists():
        raise SystemExit(f"{recipe} run failed:\n{(r.stdout + r.stderr)[-4000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="5m")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES),
                    help="which recipes (bf16 is always run: the ratios are against it)")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {r: [] for r in RECIPES if r == "bf16" or r in args.recipes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for recipe in results:
                s = run(recipe, args.model, args.steps, Path(tmp) / f"{recipe}{i}")
                results[recipe].append(s)
                print(f"round {i + 1}/{args.rounds} {recipe:8s} {s['tokens_per_s_median']:8.0f} tokens/s", flush=True)
    base = statistics.median(s["tokens_per_s_median"] for s in results["bf16"])
    rows = {}
    print(f"\n{args.model} model, 2 ranks x 1 thread, {args.steps} steps, median of {args.rounds} rounds")
    print(f"{'recipe':8s} {'tokens/s':>9s} {'vs BF16':>8s} {'peak RSS/rank (MiB)':>22s} {'weight bytes/rank':>18s}")
    for recipe, runs in results.items():
        tps = statistics.median(s["tokens_per_s_median"] for s in runs)
        rss = [max(s["peak_rss_bytes_per_rank"][k] for s in runs) / 2**20 for k in range(2)]
        rows[recipe] = {"tokens_per_s": tps, "ratio_vs_bf16": tps / base, "peak_rss_mib_per_rank": rss,
                        "weight_bytes_per_rank": runs[0]["weight_bytes_per_rank"]}
        print(f"{recipe:8s} {tps:9.0f} {tps / base:7.2f}x {rss[0]:10.0f} / {rss[1]:<9.0f} "
              f"{runs[0]['weight_bytes_per_rank']:18,d}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "steps": args.steps, "rounds": args.rounds,
                                               "recipes": rows}, indent=2))


if __name__ == "__main__":
    main()
