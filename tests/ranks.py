"""Run a scenario on N real ranks (separate processes, gloo, real DeepSpeed engines), bounded by a timeout.

A scenario is a module-level function ``scenario_x(rank: int, params: dict) -> dict`` that lives in the test
module beside the assertions that check its result. ``run_ranks(scenario_x, world_size=2, **params)`` starts
``python -m tests.ranks MODULE:scenario_x OUT.json PARAMS`` once per rank with RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT set (what the deepspeed launcher sets), and returns each rank's JSON result (the
scenario's dict plus ``rank``, ``finite`` (every ``losses`` value finite) and ``shm_segment``). A rank that fails or
hangs fails the test with every rank's log.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ds_nvfp4.zero import teardown
from ds_nvfp4.zero.shm import remove_stale_workspaces, workspace_path

ROOT = Path(__file__).resolve().parents[1]

Scenario = Callable[[int, dict], dict]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs: list[subprocess.Popen], timeout: float, grace: float = 30.0) -> bool:
    """Wait for every process; True when any failed or the wait ran out.

    A rank that raises leaves its peers blocked in a collective until the gloo timeout (30 min): once one process
    has exited non-zero, the others get ``grace`` seconds to finish (their own error report) before the caller kills
    them, so a failing scenario costs seconds of CI time, not the whole ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return any(c != 0 for c in codes)
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)


def spawn_ranks(cmd: list[str], world_size: int, logdir: Path, timeout: int) -> None:
    """Run ``cmd`` once per rank with the launcher's environment; raise with every rank's log on any failure.

    The rendezvous store is hosted here, on a port the OS assigns, and every rank joins it as a client (what
    torchrun's agent does: ``TORCHELASTIC_USE_AGENT_STORE``). A port picked free and released for rank 0 to bind
    can be taken meanwhile (another test's gloo connection, with pytest-xdist another worker's), and rank 0's
    EADDRINUSE then leaves its peer waiting until the timeout.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONPATH=str(ROOT))
        log = open(logdir / f"rank{rank}.log", "w")  # noqa: SIM115 (closed after the process ends)
        procs.append((subprocess.Popen([c.replace("{rank}", str(rank)) for c in cmd], env=env, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=ROOT), log))
    failed = wait_all([p for p, _ in procs], timeout)
    for p, log in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    # a rank killed before ds_nvfp4.initialize unlinked its shm all-reduce segment leaves 69 MB of RAM behind
    remove_stale_workspaces("127.0.0.1", port, world_size)
    del store  # the port stays taken until every rank is gone
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n" + (logdir / f"rank{r}.log").read_text()[-6000:]
                         for r in range(world_size))
        raise AssertionError(f"{' '.join(cmd[:4])} ... failed on some rank:\n{logs}")


def run_ranks(scenario: Scenario, world_size: int = 2, timeout: int = 420, **params) -> list[dict]:
    """Each rank's result of ``scenario`` (a module-level function of a ``tests`` module) on ``world_size`` ranks."""
    target = f"{scenario.__module__}:{scenario.__name__}"
    if not scenario.__module__.startswith("tests.") or "." in scenario.__qualname__:
        raise ValueError(f"{target}: a scenario is a module-level function of a tests.* module")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank{rank}.json")
        spawn_ranks([sys.executable, "-m", "tests.ranks", target, out, json.dumps(params)], world_size,
                    Path(tmp), timeout)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]


def main() -> None:
    target, out, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if params.get("count_collectives"):
        from bench import comm_count

        comm_count.install()  # before DeepSpeed builds its backend, which captures the gather/scatter functions
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    segment = workspace_path(rank, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    shm_created = segment.exists()  # DeepSpeed's CPU shm all-reduce made it in init_distributed
    module, name = target.split(":")
    result = getattr(importlib.import_module(module), name)(rank, params)
    result["rank"] = rank
    result["shm_segment"] = {"created": shm_created, "left_behind": segment.exists()}
    result["exit_teardown"] = teardown.registered()  # by ds_nvfp4.initialize (tests/zero/test_zero3.py)
    teardown.destroy_at_exit()  # also for scenarios without it: a rank that aborts at exit fails its test
    result["finite"] = all(math.isfinite(v) for v in result.get("losses", [0.0]))
    Path(out).write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
