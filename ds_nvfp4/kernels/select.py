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

from . import registry
from .base import GemmBackend
from .device import DeviceInfo, fp4_tensor_cores, read_device  # noqa: F401 (re-exported: kernels.select's API)

log = logging.getLogger("ds_nvfp4")

class BackendUnavailable(RuntimeError):
    """``precision.kernel`` asked for a backend that cannot run here (never a silent fallback)."""


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


def availability(info: DeviceInfo) -> dict[str, tuple[bool, str]]:
    """Every registered backend's ``(ok, why)`` on ``info``, most preferred first (kernels/registry.py)."""
    return {spec.name: spec.available(info) for spec in registry.specs()}


def decide(info: DeviceInfo, requested: str | None) -> Selection:
    """Pure dispatch rule. Raises BackendUnavailable when ``requested`` cannot run on ``info``."""
    cands = availability(info)
    if requested is not None:
        if requested not in cands:
            raise BackendUnavailable(f"precision.kernel: {requested!r} is not a backend (allowed: "
                                     f"{', '.join(cands)}, or null)")
        ok, why = cands[requested]
        if not ok:
            raise BackendUnavailable(f"precision.kernel: {requested!r} cannot run here: {why}. Use "
                                     f"\"kernel\": null to take the best available backend, or \"emulated\".")
        return Selection(requested, f"requested by precision.kernel; {why}", cands)
    passed_over: list[str] = []
    last = list(cands)[-1]
    for name, (ok, why) in cands.items():
        if ok:
            # the last resort (emulation) says why the preferred backend could not run ("no CUDA device: CPU")
            return Selection(name, passed_over[0] if name == last and passed_over else why, cands)
        passed_over.append(why)
    raise AssertionError("emulated is always available")


def get_backend(name: str) -> GemmBackend:
    """The backend object for ``name`` (constructed once)."""
    return _backends()[name]


@functools.cache
def _backends() -> dict[str, GemmBackend]:
    return {spec.name: spec.cls() for spec in registry.specs()}


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
