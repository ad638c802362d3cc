"""Unlink DeepSpeed's CPU shared-memory all-reduce workspace once every rank has mapped it.

DeepSpeed's CPU accelerator (``deepspeed/ops/csrc/cpu/comm/shm.cpp``, 0.19.x) gives every rank of a single-host
job a POSIX shared-memory segment ``/dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``
(about 69 MB) and never unlinks it. The name carries the port, so every run leaks ``world_size * 69 MB`` of
tmpfs, which is RAM: a few hundred short runs (a test suite, a sweep) fill ``/dev/shm`` and the kernel's OOM killer
ends the next job. Once every rank has opened every peer's segment (``shm_initialize`` loops until it has), the
names are no longer needed: unlinking them keeps the mappings alive and lets the kernel free the memory when the
last rank exits, whatever way it exits.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("ds_nvfp4")

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"


def workspace_path(rank: int, addr: str, port: str, uid: int | None = None) -> Path:
    """The segment DeepSpeed's ``shm_initialize`` creates for ``rank`` (same format string as shm.cpp)."""
    return SHM_DIR / f"{PREFIX}_{os.getuid() if uid is None else uid}_{addr}_{port}_{rank}"


def release_shm_workspace() -> Path | None:
    """Collective over the world group: unlink this rank's shm all-reduce segment, if DeepSpeed made one.

    Call after ``deepspeed.init_distributed`` (``deepspeed.initialize`` calls it). Every rank must call it (it holds
    a barrier). Returns the unlinked path, or None when there was none (GPU accelerators, multi-host jobs, where
    DeepSpeed does not use the shm all-reduce).
    """
    import deepspeed.comm as dist
    from deepspeed.comm import comm as ds_comm  # `cdb` is rebound there; deepspeed.comm.cdb stays None

    if not dist.is_initialized() or getattr(ds_comm.cdb, "shm_comm_op", None) is None:
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr is None or port is None:
        return None
    # After the barrier every peer has returned from its own shm_initialize, i.e. has mapped our segment.
    dist.barrier()
    path = workspace_path(dist.get_rank(), addr, port)
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    log.debug("ds_nvfp4: unlinked %s (mapped by every rank; freed at exit)", path)
    return path


def remove_stale_workspaces(addr: str, port: int | str, world_size: int) -> list[Path]:
    """Delete the segments of a finished (or crashed) job on ``addr:port``; for launchers and test harnesses."""
    removed = []
    for rank in range(world_size):
        path = workspace_path(rank, addr, str(port))
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed
