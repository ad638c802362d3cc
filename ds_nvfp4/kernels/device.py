"""What the backend availability rules look at: the device's capabilities (read once, or faked in tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def describe_hardware(info: DeviceInfo) -> str:
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
        return True, f"{describe_hardware(info)} (Blackwell datacenter): FP4 tensor cores, full recipe"
    if major == 12:
        return True, (f"{describe_hardware(info)} (Blackwell consumer/workstation): FP4 GEMM works; TE's RHT and "
                      "stochastic-rounding kernels fail there (TE #2255), ds_nvfp4 computes those itself")
    arch = {9: "Hopper", 8: "Ampere/Ada", 7: "Volta/Turing"}.get(major, "pre-Blackwell")
    return False, f"{describe_hardware(info)} ({arch}): no FP4 tensor cores, emulation only"


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
