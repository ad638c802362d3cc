import os

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

    if _compile.compile_enabled(torch.device("cpu")):
        _cpu_ext.extension()
