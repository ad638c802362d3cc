"""Collectives ds_nvfp4 adds on top of DeepSpeed's (deepspeed.comm, any backend)."""

from __future__ import annotations

import torch


def agree_max(values: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max of a float32 vector over the ranks of ``group``, safe for NaN/Inf.

    ``all_reduce(MAX)`` of a NaN is not defined across ranks (gloo's result depends on the rank order), so each
    non-finite value travels as a flag and is replaced by 0 in the max. One collective. Returns ``(max, bad)``,
    both ``[n]`` on ``values``' device, ``bad`` 1.0 where any rank had a non-finite value, identical on all ranks.
    """
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    bad = (~torch.isfinite(values)).float()
    both = torch.cat([torch.where(bad.bool(), torch.zeros_like(values), values), bad])
    if dist.is_initialized():
        both = both.to(get_accelerator().current_device_name())
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        both = both.to(values.device)
    return both[: len(values)], both[len(values):]
