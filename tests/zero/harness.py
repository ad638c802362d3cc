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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, world_size: int = 2, timeout: int = 420, **params) -> list[dict]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
            out = Path(tmp) / f"rank{rank}.json"
            log = open(Path(tmp) / f"rank{rank}.log", "w")  # noqa: SIM115 (closed after the process ends)
            cmd = [sys.executable, "-m", "tests.zero.worker", scenario, str(out), json.dumps(params)]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), out, log))
        failed = False
        for p, _, _ in procs:
            try:
                failed |= p.wait(timeout=timeout) != 0
            except subprocess.TimeoutExpired:
                failed = True
        for p, _, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        if failed:
            logs = "\n".join(f"--- rank {r} ---\n" + (Path(tmp) / f"rank{r}.log").read_text()[-6000:]
                             for r in range(world_size))
            raise AssertionError(f"scenario {scenario} failed on some rank:\n{logs}")
        return [json.loads(out.read_text()) for _, out, _ in procs]
