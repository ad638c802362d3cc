"""Run a function on N real ranks (separate processes, gloo, real DeepSpeed engines), bounded by a timeout.

``run_ranks(scenario, world_size=2, **kw)`` starts ``python -m tests.zero.worker SCENARIO`` once per rank with
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set (what the deepspeed launcher sets) and returns each rank's
JSON result. A rank that fails or hangs fails the test with every rank's log.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ds_nvfp4.zero.shm import remove_stale_workspaces

ROOT = Path(__file__).resolve().parents[2]


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
    """Run ``cmd`` once per rank with the launcher's environment; raise with every rank's log on any failure."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
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
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n" + (logdir / f"rank{r}.log").read_text()[-6000:]
                         for r in range(world_size))
        raise AssertionError(f"{' '.join(cmd[:4])} ... failed on some rank:\n{logs}")


def run_ranks(scenario: str, world_size: int = 2, timeout: int = 420, **params) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank{rank}.json")
        spawn_ranks([sys.executable, "-m", "tests.zero.worker", scenario, out, json.dumps(params)], world_size,
                    Path(tmp), timeout)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]
