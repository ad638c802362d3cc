"""The host allocator under the emulated GEMMs on CPU: which malloc serves the process, and whether glibc is set to
keep freed buffers (docs/benchmarks.md, CPU allocator). Environment only, no timing: `ds_nvfp4.envcheck.allocator`
measures it; the engine's start-up report uses :func:`allocator_note`."""

from __future__ import annotations

import os
import platform
from pathlib import Path

#: glibc's environment variables (read once, at process start) that keep freed CPU buffers in the process heap
#: for the next allocation: no mmap for large blocks, and the heap's top never trimmed (64 GiB threshold)
GLIBC_REUSE_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30)}
_REUSE_SETTING = " ".join(f"{k}={v}" for k, v in GLIBC_REUSE_ENV.items())
#: what the setting did, from the kept benchmarks (docs/evidence/bench/{gemm,experts}_epyc{,_reuse}.json)
_REUSE_EFFECT = ("on a 2-core EPYC with AVX512-BF16 the emulated FP4 GEMMs cost 1.02-1.12x of BF16 with it instead of "
                 "1.07-1.28x, with the same bits, for 1.27-1.49x the peak memory (docs/benchmarks.md, CPU "
                 "allocator)")


def allocator_env() -> dict[str, str]:
    """The environment variables that choose or tune this process's malloc (``MALLOC_*``, ``LD_PRELOAD``)."""
    return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}


def allocator_name(maps: str | None = None) -> str:
    """The malloc serving this process: a preloaded jemalloc/tcmalloc/mimalloc (from ``maps``, default
    /proc/self/maps), else the C library's ("glibc 2.36")."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
    for lib in ("jemalloc", "tcmalloc", "mimalloc"):
        if f"lib{lib}" in maps:
            return lib
    libc, version = platform.libc_ver()
    return f"{libc} {version}".strip() or "unknown"


def allocator_note(environ: dict[str, str] | None = None, maps: str | None = None) -> str | None:
    """The start-up note of a run whose FP4 GEMMs are emulated on this CPU while glibc page-faults every freed block
    over 32 MiB in again (:func:`allocator`), or None. From the environment alone: no timing at start-up."""
    env = os.environ if environ is None else environ
    name = allocator_name(maps)
    if not name.startswith("glibc") or all(env.get(k) == v for k, v in GLIBC_REUSE_ENV.items()):
        return None
    return (f"CPU allocator: {name} returns freed buffers over 32 MiB to the OS, so each is page-faulted in again; "
            f"set {_REUSE_SETTING} for every rank: {_REUSE_EFFECT}; `ds-nvfp4 env` measures it")
