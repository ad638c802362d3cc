"""MoE experts in a published NVFP4 checkpoint: per-expert tensors (``experts.{e}.gate_proj`` / ``up_proj`` /
``down_proj``, as ``ds-nvfp4 export``, vLLM and llm-compressor name them) read into transformers' fused 3-D experts
parameters.

An experts parameter is described by an :class:`ExpertLayout` (``nn.report.LayerDecision``, the conversion row, is
one: ``experts``, ``out_features`` N, ``in_features`` K, ``projections``: which rows of each expert's ``[N, K]``
matrix each per-expert module fills, ``transposed``, ``bias``), from ``convert_model``'s report or, without
converting, ``nn.convert.expert_layouts``; this layer only reads those fields, so it does not import nn.
:func:`experts_from_checkpoint` assembles the dequantized values (continued training, ``ds-nvfp4 merge``);
:func:`expert_codes` reads a ZeRO-3 partition's range of the stored codes (a frozen base, packed as stored).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

from ..format.constants import BLOCK_SIZE
from .hf_nvfp4 import NVFP4Checkpoint, checkpoint_name
from .metadata import CheckpointError

#: the rows of an expert's ``[N, K]`` matrix each per-expert module takes (``ExpertLayout.projections``): gate and up
#: are the two halves of a fused gate_up matrix, or its even and odd rows where a family interleaves them (GPT-OSS)
PROJECTION_ROWS: dict[str, Callable[[int], slice]] = {
    "all": lambda n: slice(0, n), "first_half": lambda n: slice(0, n // 2),
    "second_half": lambda n: slice(n // 2, n), "even": lambda n: slice(0, n, 2), "odd": lambda n: slice(1, n, 2)}


class ExpertLayout(Protocol):
    """How one fused 3-D experts parameter maps onto per-expert modules (``nn.report.LayerDecision`` fields)."""

    name: str                              # "<module>.<parameter>", e.g. "model.layers.0.mlp.experts.gate_up_proj"
    kind: str                              # "experts" for the rows this module acts on
    in_features: int                       # K
    out_features: int                      # N per expert
    experts: int | None                    # E
    transposed: bool                       # stored [E, K, N]
    projections: list[list[str]] | None    # [[module, rows], ...], rows a PROJECTION_ROWS key
    bias: str | None                       # the per-expert bias parameter [E, N], if any

#: ``(start, stop) -> (data uint8 [(stop-start)/2], scale float8_e4m3fn [(stop-start)/16], amax float32 [E])``
CodesReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def experts_from_checkpoint(ckpt: NVFP4Checkpoint, layouts: Iterable[ExpertLayout],
                            model: nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    """Each 3-D experts parameter (and its per-expert bias) of ``model`` assembled from the checkpoint's per-expert
    modules: quantized ones dequantized from their codes, BF16 ones as stored, each in the rows ``layouts`` record,
    transposed back where the parameter is stored ``[E, K, N]``. Name -> its value, made when called (float32, the
    whole parameter): once to load it, once more for the FP32 masters."""
    out: dict[str, Callable[[], torch.Tensor]] = {}
    params = dict(model.named_parameters())
    for d in layouts:
        if d.kind != "experts" or not d.projections or d.name not in params:
            continue
        site = checkpoint_name(d.name.rpartition(".")[0])
        if not any(f"{site}.0.{proj}" in ckpt.weights or f"{site}.0.{proj}.weight" in ckpt.tensors
                   for proj, _ in d.projections):
            continue  # the checkpoint stores this parameter under its own name (load_dequantized takes it)
        out[d.name] = functools.partial(assemble, ckpt, d, site, False)
        if d.bias:
            out[f"{d.name.rpartition('.')[0]}.{d.bias}"] = functools.partial(assemble, ckpt, d, site, True)
    return out


def assemble(ckpt: NVFP4Checkpoint, d: ExpertLayout, site: str, bias: bool) -> torch.Tensor:
    """``[E, N, K]`` (``[E, K, N]`` when stored transposed) or, with ``bias``, ``[E, N]`` from the per-expert
    tensors of ``site``."""
    n, k = d.out_features, d.in_features
    per = []
    for e in range(d.experts):
        t = torch.empty(n) if bias else torch.empty(n, k)
        for proj, rows in d.projections:
            module, sel = f"{site}.{e}.{proj}", PROJECTION_ROWS[rows](n)
            if bias:
                t[sel] = ckpt.tensor(f"{module}.bias").float()
            else:
                t[sel] = (ckpt.read(module).dequantize(torch.float32) if module in ckpt.weights
                          else ckpt.tensor(f"{module}.weight").float())
        per.append(t.t() if d.transposed and not bias else t)
    return torch.stack(per)


def expert_codes(ckpt: NVFP4Checkpoint, d: ExpertLayout) -> CodesReader:
    """The reader of experts weight ``d``'s stored codes by flat element range (:func:`read_expert_codes`); a
    :class:`CheckpointError` naming the tensor if an expert's projection is not NVFP4 in the checkpoint."""
    site = checkpoint_name(d.name.rpartition(".")[0])
    missing = [f"{site}.{e}.{proj}" for e in range(d.experts) for proj, _ in d.projections
               if f"{site}.{e}.{proj}" not in ckpt.weights]
    if missing:
        raise CheckpointError(f"{ckpt.folder}: {missing[0]} is not NVFP4 there, so the frozen experts weight "
                              f"{d.name} cannot be packed from the checkpoint's codes (every expert's "
                              f"{', '.join(p for p, _ in d.projections)} must be NVFP4)")
    return functools.partial(read_expert_codes, ckpt, d, site)


def read_expert_codes(ckpt: NVFP4Checkpoint, d: ExpertLayout, site: str, start: int, stop: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored codes of elements ``[start, stop)`` of the row-major ``[E, N, K]`` experts weight ``d`` (a ZeRO-3
    partition's range, multiples of 16), assembled from the per-expert tensors of ``site``: ``(data uint8
    [(stop-start)/2], scale float8_e4m3fn [(stop-start)/16], amax float32 [E])``. Each expert's projections share
    one global scale (the checkpoint's fused-group check), which becomes that expert's amax. Only the rows the range
    touches are read from disk."""
    n, k = d.out_features, d.in_features
    matrix = n * k
    amax = torch.stack([ckpt.amax(f"{site}.{e}.{d.projections[0][0]}") for e in range(d.experts)])
    data, scale, at = [], [], start
    while at < stop:
        e, off = divmod(at, matrix)
        end = min(stop, (e + 1) * matrix)
        first, last = off // k, -(-(end - e * matrix) // k)  # the expert's rows the range touches
        rows_data = torch.empty(last - first, k // 2, dtype=torch.uint8)
        rows_scale = torch.empty(last - first, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn)
        for proj, rows in d.projections:
            sel = PROJECTION_ROWS[rows](n)
            step, count = sel.step or 1, len(range(n)[sel])
            j0 = max(0, -(-(first - sel.start) // step))
            j1 = min(count, -(-(last - sel.start) // step))
            if j1 <= j0:
                continue
            q = ckpt.read(f"{site}.{e}.{proj}", slice(j0, j1))
            at_rows = torch.arange(j0, j1) * step + sel.start - first
            rows_data[at_rows], rows_scale[at_rows] = q.data, q.scale
        skip = off - first * k
        data.append(rows_data.reshape(-1).narrow(0, skip // 2, (end - at) // 2))
        scale.append(rows_scale.reshape(-1).narrow(0, skip // BLOCK_SIZE, (end - at) // BLOCK_SIZE))
        at = end
    return torch.cat(data), torch.cat(scale), amax
