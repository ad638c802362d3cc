"""Tear down gloo process groups at interpreter exit, while the interpreter is still whole.

A process that ends without ``torch.distributed.destroy_process_group()`` (every HF Trainer and Accelerate script:
neither calls it) leaves gloo's C++ worker threads holding finished work objects whose tensors refer to Python
objects. Interpreter finalization then destroys them from a thread that needs the GIL, and the process aborts
(``terminate called without an active exception``, exit code -6) *after* training, saving and printing have
finished; the launcher reports the run as failed. torch 2.13 does not guard against it (pytorch/pytorch#190489; an
``atexit`` fix in torch, PR #179291, was abandoned). Measured: a 2-rank gloo script doing all-reduce,
reduce-scatter and all-gather, then exiting, aborted in 12 and 4 of 20 launches in two invocations on a 2-core AMD
EPYC (AVX2, no AVX-512), and in none of 40 with :func:`destroy_at_exit` (one-sided Fisher p = 2e-6 pooled;
bench/teardown.py, docs/evidence/teardown/).

:func:`destroy_at_exit` registers one ``atexit`` handler per process that calls ``destroy_process_group()`` when
the default group is still initialized and uses gloo. It does nothing when the script has destroyed the groups
itself, and nothing after an unhandled exception: then a peer may still sit in a collective, and destroying a
gloo group waits for its queued work (up to the group's timeout), where leaving it lets the process end at once.
NCCL groups are left alone (torch warns about them itself, and their teardown is collective).
"""

from __future__ import annotations

import atexit
import logging
import sys

log = logging.getLogger("ds_nvfp4")

#: what a process prints when it loses the race (C++ std::terminate; exit code -6)
EXIT_ABORT = "terminate called without an active exception"

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
    if getattr(sys, "last_value", None) is not None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_backend() != "gloo":
        return
    try:
        dist.destroy_process_group()
    except Exception as err:  # at exit nothing is left to protect: say it and let the process end
        log.warning("ds_nvfp4: destroying the gloo process groups at exit failed: %s", err)
