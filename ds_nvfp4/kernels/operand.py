"""Which dtype the `emulated` backend hands its GEMM library, per device: chosen once, with the reason.

An NVFP4 element times its E4M3 block scale has at most 6 significant bits (2 from E2M1, 4 from E4M3), so the
operand values are exact in BF16 (8 bits), TF32 (11) and FP32 (24). What differs is speed:

- CPU with BF16 matrix units (AVX512-BF16, AMX): oneDNN's BF16 GEMM runs 2-3x faster than FP32 -> ``bfloat16``;
- CPU without them (or oneDNN capped below them by ``ONEDNN_MAX_CPU_ISA``): BF16 is emulated and ~4.5x slower
  than FP32 -> ``float32``;
- CUDA with tensor cores (sm_80+): ``bfloat16`` (an FP32 GEMM would run on CUDA cores, ~1/15 of the speed);
  older GPUs: ``float32``.

The numerical contract of ``emulated`` (docs/format.md): products exact, FP32 accumulation; with ``float32``
operands the output is bit-exact against the FP32-accumulated reference (same library, same order); with
``bfloat16`` operands the library rounds its FP32 accumulator to BF16 once where it cannot return FP32 (CPU),
so the output is within one BF16 ulp of that reference. ``DS_NVFP4_EMULATED_OPERAND=fp32`` (or ``bf16``)
forces a mode for tests and numerics work; ``auto`` (default) applies the rules above.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

ENV = "DS_NVFP4_EMULATED_OPERAND"
MODES = ("auto", "fp32", "bf16")
#: oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA``) below which it has no BF16 dot-product
#: instructions; BF16 GEMMs are then converted to FP32 element by element (slow)
_ONEDNN_NO_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


@dataclass(frozen=True)
class OperandChoice:
    """The operand dtype for one device type, and why."""

    dtype: torch.dtype
    reason: str

    @property
    def label(self) -> str:
        return "BF16" if self.dtype == torch.bfloat16 else "FP32"

    def describe(self) -> str:
        return f"{self.label} operands, FP32 accumulation ({self.reason})"


def cpu_bf16_units() -> tuple[bool, str]:
    """Whether this CPU's oneDNN has BF16 dot-product instructions (AMX-BF16, AVX512-BF16), and which, in words."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if cap in _ONEDNN_NO_BF16:
        return False, f"oneDNN capped at {cap} (ONEDNN_MAX_CPU_ISA): no BF16 dot-product instructions"
    import torch.cpu as cpu  # private probes, present since torch 2.3; absent -> treated as no BF16 units

    amx = getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    avx512_bf16 = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
    if amx:
        return True, "CPU with AMX-BF16"
    if avx512_bf16:
        return True, "CPU with AVX512-BF16"
    return False, "CPU without AVX512-BF16/AMX: FP32 GEMMs are faster than BF16 there"


def decide(device_type: str, capability: tuple[int, int] | None, requested: str) -> OperandChoice:
    """Pure rule (unit-tested with faked devices); ``requested`` is one of :data:`MODES`."""
    if requested not in MODES:
        raise ValueError(f"{ENV}={requested!r}: allowed values are {', '.join(MODES)}")
    if requested == "fp32":
        return OperandChoice(torch.float32, f"{ENV}=fp32: bit-exact mode")
    if requested == "bf16":
        return OperandChoice(torch.bfloat16, f"{ENV}=bf16")
    if device_type == "cuda":
        if capability is not None and capability >= (8, 0):
            return OperandChoice(torch.bfloat16, f"sm_{capability[0]}{capability[1]}: BF16 tensor cores")
        return OperandChoice(torch.float32, "GPU without BF16 tensor cores")
    ok, why = cpu_bf16_units()
    return OperandChoice(torch.bfloat16 if ok else torch.float32, why)


@functools.cache
def _choice(device_type: str, index: int | None) -> OperandChoice:
    requested = os.environ.get(ENV, "auto").strip().lower()
    capability = None
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())
    return decide(device_type, capability, requested)


def operand_choice(device: torch.device | str) -> OperandChoice:
    """The operand dtype for tensors on ``device`` (decided once per device per process)."""
    dev = torch.device(device)
    return _choice(dev.type, dev.index)


def reset() -> None:
    """Forget the decisions (tests that change the environment variable)."""
    _choice.cache_clear()
