import os
import sys

import pytest
import torch

# Fast enough for CI, thorough enough to find tie and subnormal bugs; `--hypothesis-profile=thorough` for more.
from hypothesis import settings

settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def pytest_sessionstart(session) -> None:
    """Build the C++ CPU format kernels once, before any multi-process test (torch caches the build; ranks that
    would otherwise build it concurrently inside a test's timeout just load it)."""
    from ds_nvfp4.format import _compile, _cpu_ext

    # One ninja for every process of the session: DeepSpeed's op loader runs ninja at each start, and a ninja of
    # another version than the one that wrote the build log rebuilds from scratch (the system's 1.11 and the
    # virtualenv's 1.13 alternated between launches that did or did not put the virtualenv first on PATH).
    here = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(here, "ninja")) and not os.environ["PATH"].startswith(here + os.pathsep):
        os.environ["PATH"] = here + os.pathsep + os.environ["PATH"]
    _remove_stale_build_locks()
    if _compile.compile_enabled(torch.device("cpu")):
        _cpu_ext.extension()
    # DeepSpeed's CPU backend JIT-builds its shm all-reduce op in every first init_distributed (~50 s on 2 cores).
    # Built inside a rank under a test's timeout, a kill mid-build leaves torch's FileBaton lock behind and every
    # later DeepSpeed start in the session waits on it forever; built here, ranks only load it.
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)


def _remove_stale_build_locks(max_age_s: float = 900.0) -> None:
    """Delete torch-extension build locks older than any build (left by a process killed while compiling)."""
    import time
    from pathlib import Path

    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink(missing_ok=True)
