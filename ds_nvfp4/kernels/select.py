"""Which GEMM backend a run uses, and why: decided once per run, logged once, exposed programmatically.

``decide`` is a pure function of a :class:`DeviceInfo`, so the dispatch rules are unit-tested on CPU with faked
capabilities; ``select`` probes the real device, applies ``precision.kernel`` and, for a native backend on real
hardware, runs a smoke GEMM against ``emulated`` before accepting it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from .base import GemmBackend

log = logging.getLogger("ds_nvfp4")

#: preference order when ``precision.kernel`` is null
ORDER = ("torch", "transformer_engine", "emulated")
NAMES = ("emulated", "torch", "transformer_engine")


class BackendUnavailable(RuntimeError):
    """``precision.kernel`` asked for a backend that cannot run here (never a silent fallback)."""


@dataclass(frozen=True)
class DeviceInfo:
    """What the dispatch rules look at."""

    device_type: str                      # "cpu" or "cuda"
    name: str = "CPU"
    capability: tuple[int, int] | None = None
    cuda_version: str | None = None       # torch.version.cuda
    torch_version: str = torch.__version__
    torch_fp4: bool = False               # float4_e2m1fn_x2 dtype and _scaled_mm present
    te_version: str | None = None         # transformer_engine.__version__, None when not importable


@dataclass(frozen=True)
class Selection:
    """The backend a run uses and why; ``candidates`` gives every backend's availability and reason."""

    name: str
    reason: str
    candidates: dict[str, tuple[bool, str]] = field(default_factory=dict)
    #: ``emulated`` only: the GEMM operand dtype and why (kernels/operand.py), e.g. "BF16 operands, FP32
    #: accumulation (CPU with AMX-BF16)"
    operand: str = ""

    def describe(self) -> str:
        return f"kernel: {self.name} ({self.reason})" + (f"; {self.operand}" if self.operand else "")


def _hw(info: DeviceInfo) -> str:
    if info.device_type != "cuda" or info.capability is None:
        return "no CUDA device: CPU"
    major, minor = info.capability
    return f"{info.name} is sm_{major}{minor}"


def fp4_tensor_cores(info: DeviceInfo) -> tuple[bool, str]:
    """Whether the device has FP4 tensor cores, with the reason (sm_100/103 full, sm_12x GEMM only)."""
    if info.device_type != "cuda" or info.capability is None:
        return False, "no CUDA device: CPU"
    major, _minor = info.capability
    if major in (10, 11):
        return True, f"{_hw(info)} (Blackwell datacenter): FP4 tensor cores, full recipe"
    if major == 12:
        return True, (f"{_hw(info)} (Blackwell consumer/workstation): FP4 GEMM works; TE's RHT and stochastic-"
                      "rounding kernels fail there (TE #2255), ds_nvfp4 computes those itself")
    arch = {9: "Hopper", 8: "Ampere/Ada", 7: "Volta/Turing"}.get(major, "pre-Blackwell")
    return False, f"{_hw(info)} ({arch}): no FP4 tensor cores, emulation only"


def availability(info: DeviceInfo) -> dict[str, tuple[bool, str]]:
    cores, why = fp4_tensor_cores(info)
    out = {"emulated": (True, "exact emulation, runs on any device")}
    if not cores:
        out["torch"] = (False, why)
        out["transformer_engine"] = (False, why)
        return out
    cuda_ok = info.cuda_version is not None and tuple(int(v) for v in info.cuda_version.split(".")[:2]) >= (12, 8)
    if not info.torch_fp4:
        out["torch"] = (False, f"torch {info.torch_version} lacks float4_e2m1fn_x2 / FP4 _scaled_mm (needs >= 2.8)")
    elif not cuda_ok:
        out["torch"] = (False, f"CUDA {info.cuda_version} < 12.8: cuBLASLt has no FP4 GEMM")
    else:
        out["torch"] = (True, f"{why}; torch._scaled_mm with float4_e2m1fn_x2 (cuBLASLt)")
    if info.te_version is None:
        out["transformer_engine"] = (False, "Transformer Engine is not installed (pip install '.[te]')")
    else:
        out["transformer_engine"] = (True, f"{why}; Transformer Engine {info.te_version}")
    return out


def decide(info: DeviceInfo, requested: str | None) -> Selection:
    """Pure dispatch rule. Raises BackendUnavailable when ``requested`` cannot run on ``info``."""
    cands = availability(info)
    if requested is not None:
        if requested not in NAMES:
            raise BackendUnavailable(f"precision.kernel: {requested!r} is not a backend (allowed: "
                                     f"{', '.join(NAMES)}, or null)")
        ok, why = cands[requested]
        if not ok:
            raise BackendUnavailable(f"precision.kernel: {requested!r} cannot run here: {why}. Use "
                                     f"\"kernel\": null to take the best available backend, or \"emulated\".")
        return Selection(requested, f"requested by precision.kernel; {why}", cands)
    for name in ORDER:
        ok, why = cands[name]
        if ok:
            reason = why if name != "emulated" else cands["torch"][1]
            return Selection(name, reason, cands)
    raise AssertionError("emulated is always available")


def read_device(device: torch.device | str | None = None) -> DeviceInfo:
    """Read the capabilities of ``device`` (default: the current CUDA device if any, else CPU)."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    te = None
    try:
        import transformer_engine

        te = getattr(transformer_engine, "__version__", "unknown")
    except Exception:  # absent or broken (wrong CUDA): report as not installed, the reason is logged by select
        te = None
    fp4 = hasattr(torch, "float4_e2m1fn_x2") and hasattr(torch, "_scaled_mm")
    if dev.type != "cuda":
        return DeviceInfo("cpu", torch_fp4=fp4, te_version=te)
    return DeviceInfo("cuda", torch.cuda.get_device_name(dev), torch.cuda.get_device_capability(dev),
                      torch.version.cuda, torch.__version__, fp4, te)


def get_backend(name: str) -> GemmBackend:
    """The backend object for ``name`` (constructed once)."""
    return _backends()[name]


@functools.cache
def _backends() -> dict[str, GemmBackend]:
    from .emulated import EmulatedBackend
    from .torch_native import TorchNativeBackend
    from .transformer_engine import TransformerEngineBackend

    return {b.name: b for b in (EmulatedBackend(), TorchNativeBackend(), TransformerEngineBackend())}


def smoke_test(name: str, device: torch.device) -> None:
    """Run a small GEMM on ``name`` and compare with ``emulated``; raise BackendUnavailable on any mismatch."""
    from ..format import quantize

    g = torch.Generator(device="cpu").manual_seed(0)
    a = quantize(torch.randn(128, 256, generator=g).to(device))
    b = quantize(torch.randn(64, 256, generator=g).to(device), block="16x16")
    from .emulated import reference

    want = reference.mm(a, b, torch.float32)
    try:
        got = get_backend(name).mm(a, b, torch.float32)
    except Exception as exc:
        raise BackendUnavailable(f"precision.kernel: {name!r} failed its start-up GEMM: {type(exc).__name__}: "
                                 f"{exc}") from exc
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max())):
        err = float((got - want).abs().max())
        raise BackendUnavailable(f"precision.kernel: {name!r} disagrees with the exact emulation on a 128x64x256 "
                                 f"GEMM (max abs error {err:.3g}); refusing to train with it")


_logged: set[str] = set()


def select(requested: str | None, device: torch.device | str | None = None, *, smoke: bool = True) -> Selection:
    """Choose the backend for this run (see module docstring); logs the decision once per process."""
    info = read_device(device)
    sel = decide(info, requested)
    if smoke and sel.name != "emulated":
        smoke_test(sel.name, torch.device("cuda", torch.cuda.current_device()))
    if sel.name == "emulated":
        from dataclasses import replace

        from .operand import operand_choice

        dev = torch.device("cuda", torch.cuda.current_device()) if info.device_type == "cuda" else torch.device("cpu")
        sel = replace(sel, operand=operand_choice(dev).describe())
    if sel.describe() not in _logged:
        _logged.add(sel.describe())
        log.info("ds_nvfp4 %s", sel.describe())
    return sel
