"""Tear down gloo process groups at interpreter exit, while the interpreter is still whole.

The abort: a process that used gloo can end with ``terminate called without an active exception`` (exit code -6)
*after* its training, saving and printing finished, and the launcher reports the run as failed. A core dump shows
the mechanism (docs/evidence/teardown/core_backtrace.txt): a gloo worker thread destroys each finished work object
itself (``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork``), and when Python already dropped that work's
tensors, their Python objects die with it, which needs the GIL (``decref_pyobject`` -> ``take_gil``). A thread that
asks for the GIL after finalization began is ended by ``pthread_exit``, whose unwinding through a ``noexcept``
destructor is ``std::terminate``. The worker waits for the GIL until the main thread drops it (every 5 ms of
bytecode, or in a blocking call), so a script that ends within a few ms of its last collective loses the race. torch
2.13 does not guard against it (pytorch/pytorch#190489; an ``atexit`` fix in torch, PR #179291, was abandoned).
CPython 3.14 hangs such a thread instead of ending it (python/cpython gh-87135, GH-105805), so the abort is one of
Python 3.13 and older; this project runs on 3.11.

:func:`destroy_at_exit` registers one ``atexit`` handler per process that

* calls ``destroy_process_group()`` when the default group is still initialized and uses gloo, and the script did
  not die of an exception (then a peer may still sit in a collective, and destroying a gloo group waits for its
  queued work up to the group's timeout; leaving it lets the process end at once);
* then always drains (:func:`drain_gloo_workers`): sleeps, the GIL free, until no gloo worker is runnable. This is
  local (no peer involved), so it also runs after an exception and where the script destroyed the groups itself
  (Accelerate's ``end_training()``): a group object something still holds keeps its worker threads alive.

Measured (bench/teardown.py, docs/evidence/teardown/): a 2-rank gloo script exiting right after its collectives
aborted in 7 of 15 launches with nothing at exit, and in 0 of 15 with each of: the destroy alone, the drain alone,
both (one-sided Fisher p = 0.003 each, a 2-core AMD EPYC with AVX512-BF16, beside a 2-rank training run); earlier,
12 and 4 of 20 without against 0 of 40 with the destroy (an AMD EPYC without AVX-512). The race is narrowed, not
removed: one CI run still saw two HF Trainer launches abort at exit with the destroy alone (docs/integrations.md),
so judge a run by its outputs. NCCL groups are left alone (torch warns about them itself, and their teardown is
collective).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time

log = logging.getLogger("ds_nvfp4")

#: what a process prints when it loses the race (C++ std::terminate; exit code -6)
EXIT_ABORT = "terminate called without an active exception"

#: the name torch gives gloo's worker threads (c10d ProcessGroupGloo::runLoop), as /proc/<pid>/task/*/comm shows it
GLOO_WORKER = "pt_gloo_runloop"

_state = {"registered": False}


def destroy_at_exit() -> bool:
    """Register the exit-time teardown once per process. Returns True when this call registered it."""
    if _state["registered"]:
        return False
    _state["registered"] = True
    atexit.register(_teardown)
    return True


def registered() -> bool:
    """Whether this process has the exit-time teardown (:func:`destroy_at_exit` ran)."""
    return _state["registered"]


def _teardown() -> None:
    import torch.distributed as dist

    # the interpreter sets sys.last_value when the script dies of an exception, before the atexit handlers run
    # (whatever sys.excepthook is); sys.exit(n) does not set it
    died = getattr(sys, "last_value", None) is not None
    if not died and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        try:
            dist.destroy_process_group()
        except Exception as err:  # at exit nothing is left to protect: say it and let the process end
            log.warning("ds_nvfp4: destroying the gloo process groups at exit failed: %s", err)
    # also after an exception, or when the script destroyed the groups itself: a group object that something still
    # holds keeps its workers, and the drain is local (no peer involved)
    if not drain_gloo_workers():
        log.warning("ds_nvfp4: a gloo worker thread was still running %.1f s into interpreter exit; the process may "
                    "abort (%s) after its work", DRAIN_LIMIT_S, EXIT_ABORT)


#: how long the exit-time drain waits at most for gloo's workers to go idle, and the GIL-free slices it waits in (s)
DRAIN_LIMIT_S, DRAIN_SLICE_S = 2.0, 0.01


def _thread_states(name: str) -> list[str] | None:
    """The scheduler state letters (R, S, D, ...) of this process's threads called ``name``; None without /proc."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        return None
    states = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as fh:
                if fh.read().strip() != name:
                    continue
            with open(f"{tasks}/{tid}/stat") as fh:  # "pid (comm) S ...": the state follows the last ')'
                states.append(fh.read().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
    return states


def drain_gloo_workers(limit_s: float = DRAIN_LIMIT_S, slice_s: float = DRAIN_SLICE_S) -> bool:
    """Release the GIL until every gloo worker thread of this process is idle; True when they are (or none exist).

    A worker waiting for the GIL to free a finished collective's tensors (the abort: this module's docstring) only
    gets it when the main thread drops it: every 5 ms of bytecode, or at once in a blocking call. So this sleeps in
    ``slice_s`` slices (the GIL free) until two reads of /proc in a row find no worker runnable (a worker woken for
    the GIL is runnable until it has run), at most ``limit_s``. A worker blocked inside a collective that its peer
    never joins sleeps too and counts as idle: the drain never waits on a peer. Without /proc it sleeps 5 slices
    and returns True."""
    deadline, quiet = time.monotonic() + limit_s, 0
    while True:
        time.sleep(slice_s)
        states = _thread_states(GLOO_WORKER)
        if states is None:
            time.sleep(4 * slice_s)
            return True
        if not states:
            return True
        quiet = quiet + 1 if "R" not in states else 0
        if quiet >= 2:
            return True
        if time.monotonic() > deadline:
            return False
