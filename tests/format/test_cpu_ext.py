"""The CPU extension is built once per environment and source, whatever ninja is on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LOAD = ("from ds_nvfp4.format import _cpu_ext; m = _cpu_ext.extension(); "
        "assert m is not None, _cpu_ext.unavailable_reason")


def _ninja_shim(folder: Path, real: str) -> Path:
    """A ``ninja`` that records each call in ``folder/calls`` and runs the real one."""
    folder.mkdir()
    shim = folder / "ninja"
    shim.write_text(f'#!/bin/sh\necho "$@" >> {folder}/calls\nexec {real} "$@"\n')
    shim.chmod(0o755)
    return shim


@pytest.mark.slow
def test_a_second_launch_builds_nothing_even_with_another_ninja_first_on_path(tmp_path: Path) -> None:
    """Two ninjas (as a system 1.11 and a virtualenv's 1.13 are): the first launch builds with one, the second has
    the other first on PATH and must not run ninja at all (ninja would rebuild from scratch when another version
    wrote its log)."""
    real = shutil.which("ninja") or str(Path(sys.executable).with_name("ninja"))
    if not Path(real).exists():
        pytest.skip("no ninja: the extension cannot be built here (the PyTorch kernels are used, and reported)")
    first, second = _ninja_shim(tmp_path / "a", real), _ninja_shim(tmp_path / "b", real)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), DS_NVFP4_CPU_EXT="auto")
    for shim in (first, second):
        r = subprocess.run([sys.executable, "-c", LOAD], env=dict(env, PATH=f"{shim.parent}:{env['PATH']}"),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "a" / "calls").exists(), "the first launch did not build with the ninja first on PATH"
    assert not (tmp_path / "b" / "calls").exists(), (tmp_path / "b" / "calls").read_text()
    built = list((tmp_path / "ext").glob("ds_nvfp4_cpu_*/ds_nvfp4_cpu_*.so"))
    assert len(built) == 1, built
