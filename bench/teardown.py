"""How often a 2-rank gloo job aborts at exit, with and without ds_nvfp4's exit-time teardown (zero/teardown.py).

Each trial launches ``torchrun --nproc_per_node 2`` on a small script: gloo all-reduce (async), reduce-scatter and
all-gather of BF16 tensors 20 times, print, exit without ``destroy_process_group()`` (what HF Trainer scripts do).
The arms (``--arms``, the first is the control): "without" leaves everything to interpreter exit; "destroy" only
destroys the groups at exit (the teardown before its drain); "drain" only waits, the GIL free, until no gloo worker
is runnable; "with" calls ``ds_nvfp4.zero.teardown.destroy_at_exit()``, as ``ds_nvfp4.initialize`` does (both).
A trial fails when torchrun exits non-zero; the JSON keeps each trial's exit code and whether the output held
"terminate called". The arms take turns, so all see the same machine load.

    python bench/teardown.py --trials 15 --arms without,destroy,drain,with \
        --json docs/evidence/teardown/abort_at_exit_arms.json

(kept: abort_at_exit_arms.json, on a 2-core AMD EPYC with AVX512-BF16 beside a 2-rank training run; and two
earlier invocations of the two default arms, _1 and _2, on a 2-core AMD EPYC without AVX-512, each file's
``command`` naming the path it was first written to, abort_at_exit.json)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from math import comb
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._timing import context

SCRIPT = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
sub = dist.new_group([0, 1])
t = torch.randn(1 << 16, dtype=torch.bfloat16)
for _ in range(20):
    dist.all_reduce(t, async_op=True).wait()
    dist.reduce_scatter_tensor(torch.empty(1 << 15, dtype=torch.bfloat16), t, group=sub)
    dist.all_gather([torch.empty_like(t) for _ in range(2)], t, group=sub)
arm = os.environ.get("TEARDOWN", "without")
if arm == "with":
    from ds_nvfp4.zero.teardown import destroy_at_exit
    destroy_at_exit()
elif arm == "destroy":  # the exit-time teardown before the drain: the groups destroyed, nothing waited for
    import atexit
    atexit.register(dist.destroy_process_group)
elif arm == "drain":  # only the drain: the groups stay alive, their idle workers are harmless
    import atexit
    from ds_nvfp4.zero.teardown import drain_gloo_workers
    atexit.register(drain_gloo_workers)
print("done", dist.get_rank(), flush=True)
"""

#: what each arm does at exit ("with" is what ds_nvfp4.initialize registers)
ARMS = ("without", "destroy", "drain", "with")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(script: Path, arm: str) -> dict:
    """One 2-rank launch with the exit-time ``arm`` (ARMS): its exit code and whether a rank aborted with
    "terminate called"."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, TEARDOWN=arm, OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)],
                       env=env, capture_output=True, text=True, timeout=120)
    return {"rc": r.returncode, "terminate": "terminate called" in r.stdout + r.stderr}


def fisher_one_sided(fail_a: int, n_a: int, fail_b: int, n_b: int) -> float:
    """P(arm a has >= fail_a of the fail_a + fail_b failures) when the arms do not differ (Fisher's exact test)."""
    k = fail_a + fail_b
    return sum(comb(n_a, x) * comb(n_b, k - x) for x in range(fail_a, min(n_a, k) + 1)) / comb(n_a + n_b, k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20, help="launches per arm")
    p.add_argument("--json", default=None, help="write every trial here")
    p.add_argument("--arms", default="without,with", help=f"comma-separated, of {', '.join(ARMS)}; the first is "
                                                          "the control every other arm is tested against")
    args = p.parse_args()
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or len(arms) < 2:
        p.error(f"--arms {args.arms}: give two or more of {', '.join(ARMS)} (unknown: {', '.join(unknown) or '-'})")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "job.py")
        script.write_text(SCRIPT)
        for _ in tqdm(range(args.trials), desc="trial rounds (one launch per arm)"):
            for arm in arms:
                runs[arm].append(trial(script, arm))
    counts = {arm: sum(t["rc"] != 0 for t in ts) for arm, ts in runs.items()}
    for arm, ts in runs.items():
        print(f"{arm:>8}: {counts[arm]} of {len(ts)} launches failed ({sum(t['terminate'] for t in ts)} with "
              "'terminate called')")
    control = arms[0]
    fisher = {arm: fisher_one_sided(counts[control], args.trials, counts[arm], args.trials) for arm in arms[1:]}
    for arm, p_value in fisher.items():
        print(f"one-sided Fisher exact p ({arm} does not fail less often than {control}): {p_value:.2g}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"context": context(), "control": control, "failed": counts,
                                               "fisher_p": fisher, "trials": runs}, indent=1))


if __name__ == "__main__":
    main()
