"""`convert_model`: swap eligible ``nn.Linear`` modules for NVFP4Linear, in place, and say why for each."""

from __future__ import annotations

import fnmatch
import logging

from torch import nn

from ..config import PrecisionConfig
from ..kernels import Selection, select
from .blocks import Blocks, find_blocks
from .linear import NVFP4Linear
from .recipe import Recipe
from .report import ConversionReport, LayerDecision
from .weights import FusedGroup

log = logging.getLogger("ds_nvfp4")


def _numel(p: nn.Parameter) -> int:
    """Full element count, also for ZeRO-3 partitioned parameters (whose local numel is 0)."""
    return int(getattr(p, "ds_numel", p.numel()))


def _shape(m: nn.Linear) -> tuple[int, int]:
    return m.out_features, m.in_features


def _matches(name: str, pattern: str) -> bool:
    """fnmatch against the full dotted name or any dotted suffix of it ("lm_head" matches "model.lm_head")."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def _fuse(model: nn.Module, report: ConversionReport, groups: list[list[str]]) -> None:
    """Find sibling Linears that inference engines fuse (``modules.fuse``) and make their weights share one amax.

    A group is formed under one parent module by the children whose names are in one ``fuse`` entry. Only a group
    whose members are all NVFP4 shares an amax; a group mixing NVFP4 and BF16 members is reported (vLLM and
    TensorRT-LLM cannot load a fused layer of mixed precision).
    """
    decisions = {d.name: d for d in report.layers}
    for parent, _ in model.named_modules():
        prefix = f"{parent}." if parent else ""
        for names in groups:
            members = [f"{prefix}{n}" for n in names if f"{prefix}{n}" in decisions]
            if len(members) < 2:
                continue
            fp4 = [m for m in members if decisions[m].fp4]
            if len(fp4) != len(members):
                if fp4:
                    report.notes.append(f"fused group {', '.join(members)} mixes NVFP4 and BF16 layers: inference "
                                        "engines fuse them into one GEMM of one precision; exclude all or none")
                continue
            report.fused_groups.append(members)
            group = FusedGroup([model.get_submodule(m) for m in members])
            for m in group.layers:
                m.weight_codes.group = group


def convert_model(model: nn.Module, precision: PrecisionConfig | dict, *, selection: Selection | None = None,
                  device=None, blocks: Blocks | None = None) -> ConversionReport:
    """Convert ``model`` in place per ``precision.modules`` and return the report.

    Call it before ``deepspeed.initialize`` (``ds_nvfp4.initialize`` does). Parameters keep their identity, so
    optimizers, state_dict keys and ZeRO-3 partitioned parameters are unaffected. ``blocks``: the model's
    transformer blocks when :func:`find_blocks` cannot see them (a pipeline stage: engine/pipeline.py).

    Raises:
        ValueError: ``keep_first/last_blocks_bf16`` asks for blocks the model does not have.
        kernels.BackendUnavailable: ``precision.kernel`` names a backend that cannot run here.
    """
    pc = precision if isinstance(precision, PrecisionConfig) else PrecisionConfig.model_validate(precision)
    sel = selection or select(pc.kernel, device)
    recipe = Recipe.from_config(pc, sel.name)
    mods = pc.modules
    blocks = blocks or find_blocks(model)
    report = ConversionReport(kernel=sel.name, kernel_reason=sel.reason + (f"; {sel.operand}" if sel.operand else ""),
                              blocks=blocks.describe() if blocks else None)
    first = mods.keep_first_blocks_bf16
    last = pc.last_blocks_bf16(blocks.count) if blocks else 0
    last_rule = (f"keep_last_fraction_bf16={mods.keep_last_fraction_bf16}: the last {last}"
                 if mods.keep_last_fraction_bf16 and last > mods.keep_last_blocks_bf16
                 else f"keep_last_blocks_bf16={mods.keep_last_blocks_bf16}")
    if (first or mods.keep_last_blocks_bf16 or mods.keep_last_fraction_bf16) and blocks is None:
        raise ValueError("precision.modules.keep_first_blocks_bf16/keep_last_blocks_bf16/keep_last_fraction_bf16 are "
                         "set, but the model has no repeated transformer blocks (no nn.ModuleList of >= 2 children of "
                         "one type); set them to 0 and use modules.exclude or modules.overrides patterns instead")
    if blocks and first + last > blocks.count:
        raise ValueError(f"precision.modules: keep_first_blocks_bf16 ({first}) + {last} trailing blocks "
                         f"({last_rule}) is more than the model's {blocks.count} blocks")
    if blocks is None:
        report.notes.append("no repeated transformer blocks found (no nn.ModuleList of same-type children)")

    owners: dict[int, list[str]] = {}
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
    mha_children = {f"{n}.{c}" if n else c for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)
                    for c, _ in m.named_modules() if c}
    vocab = {m.num_embeddings: n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}

    for name, m in list(model.named_modules()):
        if not isinstance(m, nn.Linear):
            continue
        n_out, n_in = _shape(m)
        weight_name = f"{name}.weight"
        shared = [o for o in owners.get(id(m.weight), []) if o != weight_name]
        excl = next((p for p in mods.exclude if _matches(name, p)), None)
        rule = next(((i, r) for i, r in enumerate(mods.overrides) if _matches(name, r.match)), None)
        idx = blocks.index_of(name) if blocks else None
        if isinstance(m, NVFP4Linear):
            fp4, reason = True, "already NVFP4Linear"
        elif name in mha_children:
            fp4, reason = False, ("read directly by nn.MultiheadAttention's fused kernel (its forward never calls "
                                  "Linear.forward)")
        elif shared:
            fp4, reason = False, f"weight shared with {', '.join(shared)} (tied): quantizing it would change that too"
        elif rule is not None and rule[1].precision == "bf16":
            fp4, reason = False, f"modules.overrides[{rule[0]}] {rule[1].match!r} -> bf16"
        elif rule is None and excl is not None:
            fp4, reason = False, f"excluded by modules.exclude pattern {excl!r}"
        elif rule is None and not any(_matches(name, p) for p in mods.include):
            fp4, reason = False, f"not matched by modules.include {mods.include}"
        elif rule is None and idx is not None and idx < first:
            fp4, reason = False, f"in block {idx} of {blocks.count} (keep_first_blocks_bf16={first})"
        elif rule is None and idx is not None and idx >= blocks.count - last:
            fp4, reason = False, f"in block {idx} of {blocks.count} ({last_rule})"
        elif n_in % 16:
            fp4, reason = False, f"in_features={n_in} is not a multiple of 16 (NVFP4 blocks run along K)"
        elif recipe.weight_block == "16x16" and n_out % 16:
            fp4, reason = False, f"out_features={n_out} is not a multiple of 16 (16x16 weight tiles)"
        else:
            fp4, reason = True, "converted" + (f" (modules.overrides[{rule[0]}] {rule[1].match!r} -> fp4)"
                                               if rule is not None else "")
            if n_out in vocab and idx is None:
                reason += (f" (note: out_features equals the vocabulary of {vocab[n_out]!r}: if this is the LM head, "
                           f"add {name!r} to modules.exclude)")
                report.notes.append(f"{name} looks like an LM head and was quantized: no exclude pattern matched it")
            NVFP4Linear.from_linear(m, recipe)
        report.layers.append(LayerDecision(name, n_in, n_out, _numel(m.weight), fp4, reason))

    _fuse(model, report, mods.fuse)
    fp4_ids = {id(model.get_submodule(d.name).weight) for d in report.layers if d.fp4}
    for p in {id(p): p for p in model.parameters()}.values():
        if id(p) in fp4_ids:
            report.fp4_params += _numel(p)
        else:
            report.bf16_params += _numel(p)
    log.debug("%s", report.table())  # ds_nvfp4.initialize shows it (rank 0, visibly); see engine.announce
    return report
