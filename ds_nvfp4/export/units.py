"""What each trained GEMM weight becomes in an export: *units* (one quantized matrix each) and pass-through tensors.

A unit is one ``[N, K]`` matrix quantized with one amax, written under one or more output module names (row
selections):

* a Linear: one unit, named as the module;
* a Conv1D (weight stored ``[in, out]``): one unit of the transposed weight; NVFP4 tensors are written in the
  ``[out, in/2]`` layout every NVFP4 loader reads, BF16 weights in Conv1D's own ``[in, out]`` layout;
* MoE experts whose layout the conversion recorded (transformers' experts interface: ``projections`` of the
  report): one unit per expert matrix, in the GEMM's ``[N, K]`` layout whatever the stored one (GPT-OSS stores
  ``[E, K, N]``), written under the per-expert names vLLM's MoE loaders and llm-compressor use
  (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``): gate and up are the two row halves (or, interleaved as
  GPT-OSS stores them, the even and odd rows) of one quantized matrix, so they share its global scale, as vLLM's
  and TensorRT-LLM's fused w13 require; per-expert biases go with them (``.bias``, BF16);
* MoE experts run through their own forward (Llama 4, DBRX: no declared layout): one unit per expert matrix in the
  stored layout, with no per-expert name (``Unit.outputs`` empty). Only the BF16 export, which transformers writes
  itself, takes them; an NVFP4 export refuses them by name.

Every unit also knows the parameter and expert it came from, so the BF16 export of a Hugging Face checkpoint puts
the dequantized weights back into the model's own parameters and lets transformers' ``save_pretrained`` write
the file (its own names and layout, per family).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checkpoint.experts import PROJECTION_ROWS
from ..checkpoint.metadata import CheckpointMetadata, LayerRecord
from ..nn.fused import groups_by_name, share_amax


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked (names the file, the tag or the layer)."""




@dataclass
class Unit:
    """One matrix ``source [N, K]`` (what the training forward quantized, float32), quantized with ``amax``.

    ``outputs``: ``(module name, rows)`` it is written under (empty: no per-module name, BF16 export only);
    ``input_amax``: the recorded max |input| (None: never observed); ``kn``: stored ``[K, N]`` (the BF16 export
    writes it back transposed); ``param`` / ``index``: the state-dict key and expert it came from."""

    key: str
    source: torch.Tensor
    outputs: list[tuple[str, slice]]
    input_amax: float | None
    kn: bool = False
    param: str = ""
    index: int | None = None
    amax: torch.Tensor = field(default=None)  # type: ignore[assignment]


def _expert_outputs(module: str, record: LayerRecord, e: int, rows: int) -> list[tuple[str, slice]]:
    return [(f"{module}.{e}.{proj}", PROJECTION_ROWS[sel](rows)) for proj, sel in record.projections or []]


def plan(sd: dict[str, torch.Tensor], meta: CheckpointMetadata
         ) -> tuple[list[Unit], dict[str, torch.Tensor], list[str], list[list[str]], list[str]]:
    """``(units, pass-through BF16 tensors, names of the GEMM modules kept BF16, fused groups, re-quantized
    groups)`` of a checkpoint's FP32 masters ``sd``."""
    records = {r.name: r for r in meta.conversion.layers}
    # what the training forward quantized: packed ZeRO-3 storage re-packs from the FP32 master; otherwise the
    # forward reads the BF16 module weight
    from_master = {r.name for r in records.values() if r.fp4} - set(meta.stored_bf16) if meta.stored_packed else set()
    biases = {f"{r.name.rsplit('.', 1)[0]}.{r.bias}": r for r in records.values() if r.kind == "experts" and r.bias
              and r.projections}
    units: list[Unit] = []
    rest: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    amax_in = meta.input_amax
    for key, value in sd.items():
        name = key.removesuffix(".weight") if key.endswith(".weight") else key
        r = records.get(name)
        if key in biases:  # per-expert biases of a declared layout: split as their weights are
            _split_bias(key, value, biases[key], rest)
            continue
        if r is None or r.kind not in ("Linear", "Conv1D", "experts"):
            if r is not None and r.kind == "router":
                kept.append(name)
            rest[key] = value
            continue
        module = name.rsplit(".", 1)[0] if r.kind == "experts" else name
        if not r.fp4:
            if r.kind == "experts" and r.projections:  # per-expert names, as engines and save_pretrained write them
                for e in range(value.shape[0]):
                    mat = value[e].t() if r.transposed else value[e]
                    for out, rows in _expert_outputs(module, r, e, mat.shape[0]):
                        rest[f"{out}.weight"] = mat[rows]
                        kept.append(out)
            else:
                rest[key] = value
                kept.append(name)
            continue
        w = value if name in from_master else value.to(torch.bfloat16).float()
        if r.kind == "experts":
            mats = w.view(r.experts, -1, w.shape[-1])  # a 2-D stacked parameter (DBRX) too
            for e in range(r.experts):
                mat = mats[e].t() if r.transposed else mats[e]
                units.append(Unit(f"{name}.{e}", mat, _expert_outputs(module, r, e, mat.shape[0]),
                                  amax_in.get(f"{name}.{e}"), kn=r.transposed, param=key, index=e))
        else:
            units.append(Unit(name, w.t() if r.kind == "Conv1D" else w, [(name, slice(0, r.out_features))],
                              amax_in.get(name), kn=r.kind == "Conv1D", param=key))
    missing = [n for n, r in records.items() if r.fp4 and not any(u.key == n or u.key.startswith(f"{n}.")
                                                                  for u in units)]
    if missing:
        raise ExportError(f"layers {missing} are NVFP4 in the checkpoint's ds_nvfp4.json but have no weight in it")
    groups, requantized = _share(units, meta)
    return units, rest, sorted(set(kept)), groups, requantized


def _split_bias(key: str, value: torch.Tensor, r: LayerRecord, rest: dict[str, torch.Tensor]) -> None:
    module = r.name.rsplit(".", 1)[0]
    for e in range(value.shape[0]):
        for out, rows in _expert_outputs(module, r, e, value.shape[1]):
            rest[f"{out}.bias"] = value[e][rows]


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
