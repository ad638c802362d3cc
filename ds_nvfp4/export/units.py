"""What each trained GEMM weight becomes in an export: *units* (one quantized matrix each) and pass-through tensors.

A unit is one ``[N, K]`` matrix quantized with one amax, written under one or more output module names (row ranges):

* a Linear: one unit, named as the module;
* a Conv1D (weight stored ``[in, out]``): one unit of the transposed weight; NVFP4 tensors are written in the
  ``[out, in/2]`` layout every NVFP4 loader reads, BF16 weights in Conv1D's own ``[in, out]`` layout;
* MoE experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``): one unit per expert matrix, written under the
  per-expert names transformers' ``save_pretrained`` uses and vLLM's MoE loaders map
  (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``); gate and up are the two row halves of one quantized
  matrix, so they share its global scale, as vLLM's and TensorRT-LLM's fused w13 require.

Experts kept BF16 are split into the same per-expert names (BF16 ``.weight``), so every export of an MoE model has
the layout ``from_pretrained`` expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoint.metadata import CheckpointMetadata, LayerRecord
from ..nn.fused import groups_by_name, share_amax


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked (names the file, the tag or the layer)."""


@dataclass
class Unit:
    """One matrix ``source [N, K]`` (what the training forward quantized, float32), quantized with ``amax``.

    ``outputs``: ``(module name, first row, end row)`` it is written under; ``input_amax``: the recorded max |input|
    (None: never observed); ``kn``: the BF16 export writes the weight transposed (Conv1D's layout)."""

    key: str
    source: torch.Tensor
    outputs: list[tuple[str, int, int]]
    input_amax: float | None
    kn: bool = False
    amax: torch.Tensor = field(default=None)  # type: ignore[assignment]


def _expert_names(record: LayerRecord) -> list[tuple[str, float]]:
    """``(projection, share of the rows)`` of an experts parameter's per-expert names."""
    param = record.name.rsplit(".", 1)[1]
    if param == "gate_up_proj":
        return [("gate_proj", 0.5), ("up_proj", 0.5)]
    return [(param, 1.0)]


def _split(module: str, record: LayerRecord, e: int, rows: int) -> list[tuple[str, int, int]]:
    out, start = [], 0
    for proj, share in _expert_names(record):
        n = int(rows * share)
        out.append((f"{module}.{e}.{proj}", start, start + n))
        start += n
    return out


def plan(sd: dict[str, torch.Tensor], meta: CheckpointMetadata
         ) -> tuple[list[Unit], dict[str, torch.Tensor], list[str], list[list[str]], list[str]]:
    """``(units, pass-through BF16 tensors, names of the GEMM modules kept BF16, fused groups, re-quantized
    groups)`` of a checkpoint's FP32 masters ``sd``."""
    records = {r.name: r for r in meta.conversion.layers}
    # what the training forward quantized: packed ZeRO-3 storage re-packs from the FP32 master; otherwise the
    # forward reads the BF16 module weight
    from_master = {r.name for r in records.values() if r.fp4} - set(meta.stored_bf16) if meta.stored_packed else set()
    units: list[Unit] = []
    rest: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    amax_in = meta.input_amax
    for key, value in sd.items():
        name = key.removesuffix(".weight") if key.endswith(".weight") else key
        r = records.get(name)
        if r is None or r.kind not in ("Linear", "Conv1D", "experts"):
            if r is not None:  # a router or another GEMM kept BF16
                kept.append(name)
            rest[key] = value
            continue
        if r.kind == "experts" and r.transposed:
            raise ExportError(f"{name}: experts stored transposed ([E, K, N]) are not exported yet; use DeepSpeed's "
                              "zero_to_fp32.py for their BF16 weights")
        module = name.rsplit(".", 1)[0] if r.kind == "experts" else name
        if not r.fp4:
            if r.kind == "experts":  # per-expert names, as save_pretrained writes them
                for e in range(value.shape[0]):
                    for out, a, b in _split(module, r, e, value.shape[1]):
                        rest[f"{out}.weight"] = value[e, a:b]
                        kept.append(out)
            else:
                rest[key] = value
                kept.append(name)
            continue
        w = value if name in from_master else value.to(torch.bfloat16).float()
        if r.kind == "experts":
            for e in range(w.shape[0]):
                units.append(Unit(f"{name}.{e}", w[e], _split(module, r, e, w.shape[1]), amax_in.get(f"{name}.{e}")))
        else:
            units.append(Unit(name, w.t() if r.kind == "Conv1D" else w, [(name, 0, r.out_features)],
                              amax_in.get(name), kn=r.kind == "Conv1D"))
    missing = [n for n, r in records.items() if r.fp4 and not any(u.key == n or u.key.startswith(f"{n}.")
                                                                  for u in units)]
    if missing:
        raise ExportError(f"layers {missing} are NVFP4 in the checkpoint's ds_nvfp4.json but have no weight in it")
    groups, requantized = _share(units, meta)
    return units, rest, sorted(set(kept)), groups, requantized


def _share(units: list[Unit], meta: CheckpointMetadata) -> tuple[list[list[str]], list[str]]:
    """Each unit's amax: its own, or its fused group's (``modules.fuse``: one global scale per fused inference GEMM).
    Returns the groups and those training could not share (re-quantized here)."""
    names = [u.key for u in units]
    groups = export_groups(names, meta.fuse_rules)
    shared = share_amax(torch.stack([u.source.abs().max() for u in units]), groups_by_name(names, groups)) \
        if units else []
    for u, a in zip(units, shared):
        u.amax = a
    trained = [sorted(g) for g in meta.conversion.fused_groups]
    return groups, [", ".join(g) for g in groups if sorted(g) not in trained]


def export_groups(layers: list[str], fuse: list[list[str]]) -> list[list[str]]:
    """Sibling NVFP4 layers an inference engine fuses into one GEMM (``precision.modules.fuse`` by name)."""
    by_parent: dict[str, list[str]] = {}
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        by_parent.setdefault(parent, []).append(leaf)
    groups = []
    for parent, leaves in by_parent.items():
        for names in fuse:
            members = [f"{parent}.{n}" if parent else n for n in names if n in leaves]
            if len(members) >= 2:
                groups.append(members)
    return groups
