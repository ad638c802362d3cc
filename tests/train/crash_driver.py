"""Run ``launch/train.py`` with one rank killed (SIGKILL, as the OOM killer or a lost node does) at a chosen point.

Usage (under any launcher): ``python tests/train/crash_driver.py WHEN RANK -- <train.py arguments>``

WHEN is ``save:<tag>`` (killed while writing its ZeRO partition of checkpoint ``<tag>``: half the file is on disk,
then the process waits 3 s so the other ranks run ahead, as a slow disk would let them, then dies) or
``backward:<n>`` (killed inside its n-th ``engine.backward``, with the other ranks in the collectives of that
step). Only the rank RANK is killed; the others run the unmodified script. This is test scaffolding: the package
has no fault-injection code.
"""

from __future__ import annotations

import io
import os
import runpy
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def die() -> None:
    print(f"crash_driver: SIGKILL at {time.time():.3f}", flush=True)  # wall clock, for the tests' bound
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_save(tag: str) -> None:
    import torch

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        name = str(f)
        if f"{os.sep}{tag}{os.sep}" in name and "optim_states" in name:
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            with open(name, "wb") as fh:  # a truncated partition, as a kill mid-write leaves it
                fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            print(f"crash_driver: rank {os.environ['RANK']} killed while writing {name}", flush=True)
            time.sleep(3)
            die()
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def kill_in_backward(n: int) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    real_backward = DeepSpeedEngine.backward
    calls = [0]

    def backward(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            print(f"crash_driver: rank {os.environ['RANK']} killed in backward {n}", flush=True)
            die()
        return real_backward(self, *args, **kwargs)

    DeepSpeedEngine.backward = backward


def main() -> None:
    # the deepspeed launcher puts --local_rank=N first; hand it on to train.py
    passed = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    when, rank, sep, *train_args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    assert sep == "--", __doc__
    if os.environ.get("RANK") == rank:
        kind, _, arg = when.partition(":")
        {"save": lambda: kill_in_save(arg), "backward": lambda: kill_in_backward(int(arg))}[kind]()
    script = str(ROOT / "launch" / "train.py")
    sys.argv = [script, *train_args, *passed]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
