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
