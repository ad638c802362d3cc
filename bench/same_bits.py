"""Does this machine reproduce a kept run bit for bit? The first steps of each run, trained again here and compared.

A seed set's pairs are meant to run on one machine; when a set spans sessions it spans machine instances (of one
type). This reruns the first ``--steps`` steps of every kept run given (its own config.json: model, ds_config,
protocol, seed, data) on 2 ranks with this checkout, and compares every step's loss and gradient norm with the kept
metrics, bit for bit. Equal bits mean this instance computes what the kept run's instance computed (same CPU
kernels, same code path for those steps); a difference names the first step that differs.

    python bench/same_bits.py docs/evidence/v3/10m/bf16_seed2 docs/evidence/v3/10m/nvfp4_zero3_seed1 \\
        --steps 8 --json docs/evidence/v3/10m/same_bits.json

The warm-up makes the learning rate of step ``s`` independent of the run's length, so a short run's first steps are
the long run's. Exit 0 when every run reproduces, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_nvfp4.envcheck import machine  # noqa: E402
from ds_nvfp4.evaluation.run_files import read_rows  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rerun(kept: Path, steps: int, out: Path, timeout: float) -> list[dict]:
    """Train the kept run's first ``steps`` steps into ``out`` and return their metrics rows. The run is stopped
    once those rows are written (its final whole-split evaluation is not needed here)."""
    args = json.loads((kept / "config.json").read_text())["args"]
    if not args.get("protocol") or args.get("protocol_deviations"):
        raise SystemExit(f"{kept}: only runs of a reference protocol without deviations are rerun here (its "
                         "config.json args: "
                         f"protocol {args.get('protocol')!r}, deviations "
                         f"{args.get('protocol_deviations')})")
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port()),
           "launch/train.py", "--deepspeed_config", args["deepspeed_config"], "--model", args["model"],
           "--seed", str(args["seed"]), "--steps", str(steps), "--ckpt-interval", "1000000000",
           "--data", args["data"], "--protocol", args["protocol"], "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    deadline = time.monotonic() + timeout
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                metrics = out / "metrics.jsonl"
                if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                    break
                time.sleep(1)
            rows = read_rows(out) if (out / "metrics.jsonl").exists() else []
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    if len(rows) < steps:
        tail = out.with_suffix(".log").read_text()[-3000:]
        raise SystemExit(f"{kept}: the rerun wrote {len(rows)} of {steps} steps; its log ends:\n{tail}")
    return rows[:steps]


def compare(kept_rows: list[dict], new_rows: list[dict]) -> dict:
    """Per step: both losses and gradient norms and whether each is bit-identical (float equality of the JSON
    values, which round-trip float64 exactly)."""
    steps = []
    for a, b in zip(kept_rows, new_rows):
        steps.append({"step": a["step"], "kept_loss": a["loss"], "loss": b["loss"],
                      "kept_grad_norm": a.get("grad_norm"), "grad_norm": b.get("grad_norm"),
                      "same": a["loss"] == b["loss"] and a.get("grad_norm") == b.get("grad_norm")})
    first = next((s["step"] for s in steps if not s["same"]), None)
    return {"steps": steps, "identical": first is None, "first_difference": first}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="kept run directories (config.json, metrics.jsonl[.gz])")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per rerun")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="same-bits-") as tmp:
        for run in a.runs:
            kept_cfg = json.loads((run / "config.json").read_text())
            new = rerun(run, a.steps, Path(tmp) / run.name, a.timeout)
            r = compare(read_rows(run)[:a.steps], new)
            r["kept_machine"] = kept_cfg.get("machine")
            results[str(run)] = r
            verdict = "bit-identical" if r["identical"] else f"differs from step {r['first_difference']}"
            print(f"{run}: first {a.steps} steps {verdict}")
    out = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "steps": a.steps,
           "machine": machine(), "python": platform.python_version(), "runs": results}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["identical"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
