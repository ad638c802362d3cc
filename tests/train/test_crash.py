"""A rank killed (SIGKILL) under the real ``deepspeed`` launcher: while a checkpoint is written, and mid-step.

A week-long run loses a node sooner or later. What must hold: the job ends (non-zero, within seconds, no rank left
waiting in a collective), ``latest`` still names the last *complete* checkpoint, and ``--resume`` continues from it
exactly. ``crash_driver.py`` kills one rank at the chosen point; the other rank runs the unmodified script.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_nvfp4.evaluation.data import prepare_text
from ds_nvfp4.zero.shm import remove_stale_workspaces
from tests.integrations.hf_run import env
from tests.ranks import ROOT, free_port

pytestmark = pytest.mark.slow
DRIVER = Path(__file__).with_name("crash_driver.py")
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
#: seconds from the kill to the end of the job. The launcher polls its ranks every second and kills the survivors on
#: the first non-zero exit; gloo raises in the survivor as soon as the peer's socket closes. Measured: ~1-2 s.
#: Anything near this bound is a hang.
BOUND_S = 30


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    prepare_text((ROOT / "tests" / "fixtures" / "shakespeare_sample.txt").read_bytes(), d, "tests/fixtures sample")
    return d


def launch(data: Path, out: Path, script_args: list[str], timeout: int = 600) -> tuple[int, float, str]:
    """``deepspeed --num_gpus 2 SCRIPT ARGS`` with train.py's arguments; returns (exit code, seconds from the
    driver's kill to the end of the launcher (inf if nothing was killed), log)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    train_args = ["--deepspeed_config", str(ROOT / "ds_configs" / "nvfp4_zero3.json"), "--model", "1m", "--seq", "64",
                  "--steps", "8", "--eval-interval", "4", "--eval-batches", "2", "--warmup", "4",
                  "--ckpt-interval", "2", "--data", str(data), "--out", str(out)]
    cmd = [str(DEEPSPEED), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
           *script_args, *train_args]
    log = out / f"launcher{port}.log"
    with open(log, "w") as fh:
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                               start_new_session=True)
            code = r.returncode
        except subprocess.TimeoutExpired:
            code = None
    ended = time.time()
    remove_stale_workspaces("127.0.0.1", port, 2)
    # nothing of this job may survive it (a rank stuck in a collective would hold the machine)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    for pid in left:
        subprocess.run(["kill", "-9", pid])
    assert not left, f"processes of the job outlived it: {left}\n{log.read_text()[-4000:]}"
    assert code is not None, f"the job did not end within {timeout} s:\n{log.read_text()[-6000:]}"
    text = log.read_text()
    killed = re.search(r"crash_driver: SIGKILL at ([0-9.]+)", text)
    return code, ended - float(killed.group(1)) if killed else math.inf, text


def rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_rank_killed_while_saving_keeps_latest_on_the_last_complete_checkpoint(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # rank 1 dies half-way through writing its ZeRO partition of step4, 3 s after rank 0 finished its own files
    code, seconds, log = launch(data, out, [str(DRIVER), "save:step4", "1", "--"])
    assert "killed while writing" in log
    assert code != 0, f"the launcher reported success after a rank was killed:\n{log[-4000:]}"
    assert seconds < BOUND_S, f"the job ended {seconds:.1f} s after a rank was killed"
    ckpt = out / "ckpt"
    assert (ckpt / "latest").read_text() == "step2", "latest must name the last checkpoint every rank completed"
    assert (ckpt / "step4").exists()  # the torn checkpoint is there, and ignored
    assert not list(ckpt.glob("*.tmp*")), "a temporary file was left behind"
    before = rows(out)
    assert [r["step"] for r in before] == [1, 2, 3]  # step 4's row is written after its save

    code, _, log = launch(data, out, [str(ROOT / "launch" / "train.py"), "--resume"])
    assert code == 0, log[-6000:]
    after = rows(out)
    assert [r["step"] for r in after] == list(range(1, 9))
    # resumed from step 2: step 3 recomputed from the checkpoint equals step 3 of the killed run, bit for bit
    assert after[2]["loss"] == before[2]["loss"]
    assert (ckpt / "latest").read_text() == "step8"
    assert json.loads((ckpt / "step4" / "ds_nvfp4.json").read_text())["packed"] is True  # step4 rewritten whole


def test_rank_killed_mid_step_ends_the_job(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # backward 5 is step 5 (no gradient accumulation): the survivor waits in that step's reduce-scatter
    code, seconds, log = launch(data, out, [str(DRIVER), "backward:5", "1", "--"], timeout=300)
    assert "killed in backward 5" in log
    assert code != 0, f"the launcher reported success after a rank was killed:\n{log[-4000:]}"
    assert seconds < BOUND_S, f"the job ended {seconds:.1f} s after a rank was killed"
    assert (out / "ckpt" / "latest").read_text() == "step4"
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]
