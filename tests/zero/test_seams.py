"""Every DeepSpeed name ds_nvfp4 relies on is declared (zero/seams.py) and checked at initialize: each one, removed
from a real engine, stops ``initialize``'s check with an error that names it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ds_nvfp4.zero import seams
from tests.ranks import ROOT


def test_the_tested_range_is_enforced_for_packed_storage_and_said_otherwise(monkeypatch) -> None:
    for version in ("0.19.8", "0.19.9+cpu"):
        monkeypatch.setattr(seams, "deepspeed_version", lambda v=version: v)
        assert seams.check_version(packed=True) is None
    for version in ("0.19.7", "0.20.0", "1.0.0"):
        monkeypatch.setattr(seams, "deepspeed_version", lambda v=version: v)
        with pytest.raises(seams.UnsupportedDeepSpeed, match=rf"DeepSpeed {version} is outside.*"
                                                              "DS_NVFP4_ALLOW_UNTESTED_DEEPSPEED"):
            seams.check_version(packed=True)
        assert "outside the range" in seams.check_version(packed=True, allow_untested=True)
        assert "outside the range" in seams.check_version(packed=False)  # BF16 storage: a warning only


def test_installed_deepspeed_is_in_the_tested_range() -> None:
    """CI installs what pyproject allows: the check must accept it (else every packed run would refuse)."""
    assert seams.check_version(packed=True) is None, seams.deepspeed_version()


@pytest.mark.slow
def test_each_seam_removed_from_a_real_engine_is_named() -> None:
    r = subprocess.run([sys.executable, "-m", "tests.zero.seam_worker"], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, env={**__import__("os").environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["intact"] is None, result["intact"]  # the real engines have every seam
    assert set(result["errors"]) == {s.name for s in seams.SEAMS}
    for name, error in result["errors"].items():
        assert error is not None, f"{name}: removing it raised nothing"
        assert name in error and "lacks what ds_nvfp4 relies on" in error, (name, error)
