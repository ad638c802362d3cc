from pathlib import Path

import pytest

from tests.integrations.hf_run import run_hf_trainer


@pytest.fixture(scope="session")
def hf_trainer_run(tmp_path_factory) -> Path:
    """One unmodified HF Trainer run on 2 ranks; its checkpoint-6 folder feeds the export tests."""
    return run_hf_trainer(tmp_path_factory.mktemp("hf"))
