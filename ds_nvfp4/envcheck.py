"""`ds-nvfp4 env`: does this node run NVFP4 natively, and if not, why (hardware, software, a smoke test)."""

from __future__ import annotations

import platform
import resource
import time
from pathlib import Path
from typing import Any

import torch

from .kernels import availability, cpu_bf16_units, decide, fp4_tensor_cores, get_backend, read_device
from .kernels.cpu_allocator import (  # noqa: F401  (GLIBC_REUSE_ENV, allocator_note: part of this module's API)
    _REUSE_EFFECT,
    _REUSE_SETTING,
    GLIBC_REUSE_ENV,
    allocator_env,
    allocator_name,
    allocator_note,
)


def _version(dist: str) -> str | None:
    """Installed version of a distribution, without importing it (DeepSpeed prints on import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz") from ``cpuinfo`` (default:
    /proc/cpuinfo); the architecture ("x86_64", "aarch64") where no model name is given."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """What picks a run's BF16 GEMM kernels, and so its bits: ``{"device", "name", "bf16_gemm"}``.

    Two runs of one recipe, seed and data order are bit-identical on one machine and not across machines whose
    entries differ here (oneDNN runs AMX, AVX512-BF16 or converting kernels, which round the FP32 accumulator at
    other points; CUDA picks kernels per architecture): `launch/train.py` records it in each run's config.json and
    `ds-nvfp4 compare` says when the two runs' differ."""
    info = read_device()
    if info.device_type == "cuda":
        return {"device": "cuda", "name": info.name, "bf16_gemm": f"sm_{info.capability[0]}{info.capability[1]}"}
    return {"device": "cpu", "name": cpu_model(), "bf16_gemm": cpu_bf16_units()[1]}


def hardware() -> dict[str, Any]:
    info = read_device()
    cores, why = fp4_tensor_cores(info)
    out: dict[str, Any] = {**machine(), "fp4_tensor_cores": cores, "fp4_reason": why}
    if info.device_type == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        out.update(compute_capability=f"{info.capability[0]}.{info.capability[1]}",
                   memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    else:
        out.update(threads=torch.get_num_threads())
    return out


def software() -> dict[str, Any]:
    from .kernels.transformer_engine import TESTED_RANGE as TE_RANGE
    from .kernels.transformer_engine import in_tested_range
    from .zero.seams import TESTED_RANGE

    ds = _version("deepspeed")
    te = _version("transformer-engine") or _version("transformer_engine")
    in_range = None
    if ds:
        from packaging.version import Version

        in_range = TESTED_RANGE[0] <= Version(ds.split("+")[0]) < TESTED_RANGE[1]
    mpi = {"mpi4py": _version("mpi4py"), "library": None}
    if mpi["mpi4py"]:
        try:
            import mpi4py

            # Only ask which library: MPI_Init here would abort under srun without PMI support, and would make
            # this check a member of the job's MPI world under mpirun.
            mpi4py.rc.initialize = mpi4py.rc.finalize = False
            from mpi4py import MPI

            mpi["library"] = MPI.Get_library_version().strip().splitlines()[0]
        except Exception as exc:  # mpi4py present but no MPI runtime: that is the answer
            mpi["library"] = f"unavailable ({exc})"
    dist = torch.distributed.is_available()
    return {
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "deepspeed": ds, "deepspeed_in_tested_range": in_range,
        "deepspeed_tested_range": f"{TESTED_RANGE[0]} <= v < {TESTED_RANGE[1]}",
        "transformer_engine": te, "transformer_engine_in_tested_range": in_tested_range(te),
        "transformer_engine_tested_range": f"{TE_RANGE[0]} <= v < {TE_RANGE[1]}", "mpi": mpi,
        "gloo": dist and torch.distributed.is_gloo_available(),
        "nccl": dist and torch.distributed.is_nccl_available(),
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
    }


def allocator(probe_mib: int = 64, repeats: int = 9) -> dict[str, Any]:
    """Whether a large CPU tensor, freed and allocated again, comes back without page faults.

    glibc's malloc serves every block over 32 MiB (its largest mmap threshold) with a fresh ``mmap`` and returns it
    on free, so each such temporary (an operand's values, a GEMM output) is page-faulted in again, one 4 KiB page at
    a time, on every use. On a CPU that costs more than the arithmetic of a quantize pass: the emulated FP4 paths
    allocate more such temporaries than BF16 and pay most of their overhead there (docs/benchmarks.md, "CPU
    allocator").

    Decided by counting, not timing: the minor page faults (``getrusage``, this process) of writing ``probe_mib`` MiB
    into a freshly allocated tensor, fewest of ``repeats``. A reusing allocator hands back pages already mapped (0
    faults once its heap has grown to fit, after a few allocations: torch's aligned blocks need a little more than
    the block just freed); glibc's default faults every 4 KiB page in again (``probe_mib * 256``), or
    every 2 MiB huge page where transparent huge pages are always on, which costs 512x less and counts as reusing
    here. A count is the same on a busy machine; the milliseconds, kept for the message, are not (timed, 3-4 busy
    processes on 2 cores once made a reusing allocator look faulting).

    Returns ``{"name", "env" (the MALLOC_* variables set), "fresh_faults" (page faults per fresh write),
    "fresh_ms", "reused_ms" (min of ``repeats`` each, alternating), "reuses" (fewer than one fault per 256 KiB
    written), "advice" (str, or None when nothing to do)}``.
    """
    n = probe_mib << 20

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def fresh() -> None:
        t = torch.empty(n, dtype=torch.uint8)
        t.fill_(1)

    buf = torch.empty(n, dtype=torch.uint8)
    buf.fill_(0)
    best = {"fresh_ms": float("inf"), "reused_ms": float("inf")}
    fresh_faults = n
    for _ in range(repeats):
        for key, fn in (("fresh_ms", fresh), ("reused_ms", lambda: buf.fill_(1))):
            f0, t0 = faults(), time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
            if key == "fresh_ms":
                fresh_faults = min(fresh_faults, faults() - f0)
    timed = {key: round(s * 1e3, 3) for key, s in best.items()}
    name = allocator_name()
    env = allocator_env()
    reuses = fresh_faults < probe_mib * 4
    advice = None
    if not reuses:
        advice = (f"each freed buffer over 32 MiB is page-faulted in again ({fresh_faults} page faults and "
                  f"{timed['fresh_ms']:.1f} ms to write {probe_mib} MiB afresh, against {timed['reused_ms']:.1f} ms "
                  "to rewrite it): "
                  + (f"start the processes with {_REUSE_SETTING} (multi-node: in .deepspeed_env)"
                     if name.startswith("glibc") else f"with {name}, its own settings decide; glibc with "
                     f"{_REUSE_SETTING} reuses them") + f"; {_REUSE_EFFECT}")
    return {"name": name, "env": env, "fresh_faults": fresh_faults, **timed, "reuses": reuses, "advice": advice}


def smoke_test() -> list[dict[str, Any]]:
    """Quantize + a 128x64x256 GEMM through every available backend, each compared with an independent reference:
    the dequantized operands multiplied in float64 (the exact product of what an FP4 tensor core multiplies)."""
    from .format import quantize
    from .kernels import operand_choice

    info = read_device()
    dev = torch.device("cuda", torch.cuda.current_device()) if info.device_type == "cuda" else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    a_src, b_src = torch.randn(128, 256, generator=g).to(dev), torch.randn(64, 256, generator=g).to(dev)
    a, b = quantize(a_src), quantize(b_src, block="16x16")
    ref = (a.dequantize(torch.float32).double() @ b.dequantize(torch.float32).double().t()).float()
    exact = a_src @ b_src.t()
    out = []
    for name, (ok, why) in availability(info).items():
        row: dict[str, Any] = {"backend": name, "available": ok, "reason": why}
        if ok:
            try:
                t0 = time.perf_counter()
                got = get_backend(name).mm(a, b, torch.float32)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                row["ms"] = round((time.perf_counter() - t0) * 1e3, 3)
                row["max_abs_diff_vs_reference"] = float((got - ref).abs().max())
                # FP32 accumulation of K=256 exact products: within a few FP32 ulps of the float64 reference;
                # BF16-operand emulation may round the accumulator to BF16 once (kernels/operand.py): 2^-8 relative
                rtol = 1e-5
                if name == "emulated":
                    choice = operand_choice(dev)
                    row["operand"] = choice.describe()
                    rtol = 2.0 ** -8 if choice.dtype == torch.bfloat16 else rtol
                row["matches_reference"] = bool(torch.allclose(got, ref, rtol=rtol,
                                                               atol=1e-6 * float(ref.abs().max())))
                row["rel_error_vs_fp32"] = float((got - exact).norm() / exact.norm())
            except Exception as exc:
                row.update(available=False, reason=f"smoke test failed: {type(exc).__name__}: {exc}")
        out.append(row)
    return out


def format_kernels() -> dict[str, Any]:
    """Whether the CPU quantize/dequantize kernels run compiled, and any that fell back to eager (with why).

    Call after :func:`smoke_test`: its quantizations are what compiles and verifies the kernels.
    """
    from .format import _compile, _cpu_ext

    compiled = _compile.compile_enabled(torch.device("cpu"))
    cpp = compiled and _cpu_ext.extension() is not None
    return {"compiled": compiled, "policy": _compile._policy(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "eager_fallbacks": _compile.status(),
            "cpp_kernels": cpp, "cpp_kernels_reason": None if cpp else (_cpu_ext.unavailable_reason or
                                                                        "compiled kernels are off")}


def check_config(path: str) -> tuple[bool, str]:
    """Can the precision section of ``path`` run on this node? (ok, reason)."""
    from .config import ConfigError, UnreadableConfig, load_config
    from .kernels import BackendUnavailable

    try:
        ds, pc = load_config(path)
    except (ConfigError, UnreadableConfig) as exc:
        return False, str(exc)
    if not pc.enabled:
        return True, "precision.enabled is false: plain DeepSpeed"
    try:
        sel = decide(read_device(), pc.kernel)
    except BackendUnavailable as exc:
        return False, str(exc)
    sw = software()
    if pc.stored_packed(ds.get("zero_optimization", {}).get("stage", 0)) and \
            ds.get("zero_optimization", {}).get("stage") == 3:
        if not sw["deepspeed"]:
            return False, "DeepSpeed is not installed"
        if not sw["deepspeed_in_tested_range"]:
            return False, (f"DeepSpeed {sw['deepspeed']} is outside {sw['deepspeed_tested_range']} (packed ZeRO-3 "
                           "storage relies on its internals); set DS_NVFP4_ALLOW_UNTESTED_DEEPSPEED=1 to try")
    return True, f"runs here: {sel.describe()}"


def check_environment(config: str | None = None) -> dict[str, Any]:
    """Everything `ds-nvfp4 env` shows: hardware, software, the default kernel, smoke GEMMs, the format kernels and
    (with ``config``) whether that precision section can run here."""
    hw, sw = hardware(), software()
    sel = decide(read_device(), None)
    out = {"node": platform.node(), "hardware": hw, "software": sw,
           "default_kernel": {"name": sel.name, "reason": sel.reason}, "smoke_test": smoke_test(),
           "format_kernels": format_kernels()}
    if hw["device"] == "cpu":  # the host allocator matters where the GEMMs run on the CPU
        out["allocator"] = allocator()
    if config:
        ok, why = check_config(config)
        out["config"] = {"file": config, "runs_here": ok, "reason": why}
    return out
