"""Fused groups: sibling weights that inference engines multiply as one GEMM, and so share one global scale.

vLLM and TensorRT-LLM fuse ``q_proj/k_proj/v_proj`` into ``qkv_proj`` and ``gate_proj/up_proj`` into
``gate_up_proj``; a fused NVFP4 GEMM has *one* per-tensor amax. Training with that shared amax makes an export
exact (the codes of each member are the ones training multiplied). Three places need the shared value, and all
three call :func:`share_amax`: a layer holding full weights (ZeRO-0/1/2, no DeepSpeed), the packed ZeRO-3
storage (every rank's partition amaxes, after their all-reduce) and the export (amaxes of the FP32 masters).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def share_amax(amax: torch.Tensor, groups: Iterable[Sequence[int]]) -> torch.Tensor:
    """``amax`` float32 ``[n, ...]`` with each group's members set to the group's max, element-wise over the
    trailing dims (one amax per expert matrix for 3-D expert weights: ``[n, E]``). A new tensor; indices not in
    any group keep their value."""
    out = amax.clone()
    for members in groups:
        at = list(members)
        if len(at) > 1:
            out[at] = out[at].amax(0)
    return out


def groups_by_name(names: Sequence[str], groups: Iterable[Sequence[str]]) -> list[list[int]]:
    """The index groups of :func:`share_amax` for ``groups`` given by name (members not in ``names`` dropped;
    groups left with fewer than two members dropped)."""
    index = {n: i for i, n in enumerate(names)}
    out = []
    for g in groups:
        at = [index[n] for n in g if n in index]
        if len(at) > 1:
            out.append(at)
    return out
