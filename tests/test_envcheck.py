"""`ds-nvfp4 env`: the report's fields, the smoke test, and the exit status for a config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

PRESETS = Path(__file__).resolve().parents[1] / "ds_configs"


def env(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_nvfp4", "env", *args], capture_output=True, text=True, timeout=300)


def test_json_report() -> None:
    r = env("--json", "--config", str(PRESETS / "nvfp4_zero3.json"))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["software"]["torch"] == torch.__version__ and rep["software"]["gloo"] is True
    emulated = next(row for row in rep["smoke_test"] if row["backend"] == "emulated")
    assert emulated["available"] and emulated["matches_reference"] and 0.05 < emulated["rel_error_vs_fp32"] < 0.3
    assert rep["config"]["runs_here"] is True
    if not torch.cuda.is_available():
        assert rep["hardware"]["fp4_tensor_cores"] is False and rep["default_kernel"]["name"] == "emulated"
        assert all(not row["available"] for row in rep["smoke_test"] if row["backend"] != "emulated")


def test_config_that_cannot_run_here_exits_1(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        return
    cfg = json.loads((PRESETS / "nvfp4_zero3.json").read_text())
    cfg["precision"]["kernel"] = "torch"
    f = tmp_path / "c.json"
    f.write_text(json.dumps(cfg))
    r = env("--config", str(f))
    assert r.returncode == 1 and "CANNOT RUN" in r.stdout and "no CUDA device" in r.stdout


def test_invalid_config_exits_1(tmp_path: Path) -> None:
    f = tmp_path / "bad.json"
    f.write_text('{"precision": {"enabled": true}}')
    r = env("--config", str(f))
    assert r.returncode == 1 and "bf16.enabled: true" in r.stdout


def test_the_machine_is_named_by_its_cpu_model_and_bf16_units() -> None:
    """Runs record it (config.json "machine") because BF16 GEMM kernels, and so a run's bits, differ between CPUs."""
    from ds_nvfp4.envcheck import cpu_model, machine

    xeon = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
    assert cpu_model(xeon) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert cpu_model("processor\t: 0\nBogoMIPS\t: 50.00\n") not in ("", "CPU")  # no model name: the architecture
    if torch.cuda.is_available():
        return
    m = machine()
    assert m["device"] == "cpu" and m["name"] not in ("", "CPU")
    assert m["bf16_gemm"].startswith(("CPU with", "oneDNN capped")), m
    r = env()
    assert r.returncode == 0 and f"hardware   {m['name']} (cpu)" in r.stdout and m["bf16_gemm"] in r.stdout, r.stdout


def test_allocator_check_tells_whether_freed_buffers_come_back_without_page_faults() -> None:
    """glibc unmaps freed blocks over 32 MiB, so each large temporary is page-faulted in again (most of the CPU
    emulation's overhead, docs/benchmarks.md); with GLIBC_REUSE_ENV it keeps them. The check measures it and, when
    the faults are there, says which variables to set."""
    import os

    from ds_nvfp4.envcheck import GLIBC_REUSE_ENV, allocator_name

    assert allocator_name("7f0 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n") == "jemalloc"
    if torch.cuda.is_available():
        return
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    reports = {}
    for name, extra in (("default", {}), ("reuse", GLIBC_REUSE_ENV)):
        r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "env", "--json"], capture_output=True, text=True,
                           timeout=300, env={**base, **extra})
        assert r.returncode == 0, r.stderr
        reports[name] = json.loads(r.stdout)["allocator"]
    reuse = reports["reuse"]
    assert reuse["reuses"] is True and reuse["advice"] is None and reuse["env"] == GLIBC_REUSE_ENV, reuse
    default = reports["default"]
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    huge_pages_always = thp.exists() and "[always]" in thp.read_text()
    if default["name"].startswith("glibc") and not huge_pages_always:
        # glibc's default mmaps a 64 MiB block afresh on every allocation, faulted in 4 KiB at a time (with
        # transparent huge pages always on, the faults are 512x fewer and the measurement decides alone); counted
        # faults, not the milliseconds (reported, not asserted), so that a busy machine cannot turn the answer
        assert default["reuses"] is False and default["fresh_faults"] >= 64 * 256 // 2, default
    assert reuse["fresh_faults"] < 64 * 4, reuse
    if not default["reuses"]:
        assert "MALLOC_MMAP_MAX_=0" in default["advice"] and "docs/benchmarks.md" in default["advice"]
    else:
        assert default["advice"] is None
    r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "env"], capture_output=True, text=True, timeout=300,
                       env={**base, **GLIBC_REUSE_ENV})
    assert "allocator" in r.stdout and "reuses freed buffers" in r.stdout


def test_allocator_note_names_the_settings_only_where_glibc_page_faults() -> None:
    """The start-up note (engine/initialize.py, emulated GEMMs on CPU) is decided from the environment alone."""
    from ds_nvfp4.envcheck import GLIBC_REUSE_ENV, allocator_note

    glibc_maps = "7f0 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    note = allocator_note({}, glibc_maps)
    if not note:  # not a glibc system: nothing to advise
        return
    assert "MALLOC_MMAP_MAX_=0" in note and "MALLOC_TRIM_THRESHOLD_=" in note and "same bits" in note
    assert allocator_note(dict(GLIBC_REUSE_ENV), glibc_maps) is None
    assert allocator_note({"MALLOC_MMAP_MAX_": "0"}, glibc_maps) is not None  # the heap's top would still be trimmed
    assert allocator_note({}, glibc_maps + "7f1 r-xp 0 08:01 2 /usr/lib/libjemalloc.so.2\n") is None
