"""`convert_model`: turn the model's GEMM modules FP4 in place, and say why for each one that is not.

GEMM modules it knows: ``nn.Linear`` (-> ``NVFP4Linear``), GPT-2-style ``Conv1D`` (nn/conv1d.py) and MoE experts
with 3-D expert weights (nn/experts.py). Routers (``*Router`` modules) and any other module with a matrix weight
that is not one of those are listed as BF16 with the reason, so the report accounts for every GEMM.
"""

from __future__ import annotations

import fnmatch
import logging

from torch import nn

from ..config import PrecisionConfig
from ..kernels import Selection, select
from .blocks import Blocks, find_blocks
from .conv1d import FP4Conv1D, conv1d_blocker, is_conv1d
from .experts import FP4Experts, experts_blocker, gemm_shapes, is_experts
from .linear import NVFP4Linear
from .module import FP4Module
from .recipe import Recipe
from .report import ConversionReport, LayerDecision
from .weights import FusedGroup

log = logging.getLogger("ds_nvfp4")


def _numel(p: nn.Parameter) -> int:
    """Full element count, also for ZeRO-3 partitioned parameters (whose local numel is 0)."""
    return int(getattr(p, "ds_numel", p.numel()))


def _kind(m: nn.Module) -> str | None:
    """The GEMM kind of a module ("Linear", "Conv1D", "experts", "router", "other"), None when it has no GEMM."""
    if isinstance(m, FP4Module):
        return m.kind
    if isinstance(m, nn.Linear):
        return "Linear"
    if is_conv1d(m):
        return "Conv1D"
    if is_experts(m):
        return "experts"
    weight = m._parameters.get("weight")
    if weight is None or len(getattr(weight, "ds_shape", weight.shape)) < 2 or isinstance(m, nn.Embedding):
        return None
    return "router" if type(m).__name__.lower().endswith("router") else "other"


def _matches(name: str, pattern: str) -> bool:
    """fnmatch against the full dotted name or any dotted suffix of it ("lm_head" matches "model.lm_head")."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def _gemm_weights(m: nn.Module, kind: str) -> list[tuple]:
    """``(report-name function, parameter name, (experts or None, N, K))`` of each GEMM weight of a module."""
    if kind == "experts":
        return [((lambda name, p=p: f"{name}.{p}"), p, shape) for p, shape in gemm_shapes(m).items()]
    n_out, n_in = (m.nf, m.nx) if kind == "Conv1D" else (m.out_features, m.in_features)
    return [((lambda name: name), "weight", (None, n_out, n_in))]


def _blocker(m: nn.Module, kind: str, recipe: Recipe) -> str | None:
    """A shape or layout reason why the module cannot run FP4 GEMMs, or None."""
    if kind == "Conv1D":
        return conv1d_blocker(m, recipe)
    if kind == "experts":
        return experts_blocker(m, recipe)
    if m.in_features % 16:
        return f"in_features={m.in_features} is not a multiple of 16 (NVFP4 blocks run along K)"
    if recipe.weight_block == "16x16" and m.out_features % 16:
        return f"out_features={m.out_features} is not a multiple of 16 (16x16 weight tiles)"
    return None


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
        kind = _kind(m)
        if kind is None:
            continue
        if kind in ("router", "other"):
            w = m._parameters["weight"]
            shape = tuple(getattr(w, "ds_shape", w.shape))
            why = ("a router: its GEMM decides the routing, which stays BF16 (as in every NVFP4 recipe)"
                   if kind == "router" else f"{type(m).__name__} is not a GEMM module ds_nvfp4 converts (nn.Linear, "
                                            "Conv1D, MoE experts)")
            report.layers.append(LayerDecision(name, shape[-1], shape[0], _numel(w), False, why, kind=kind))
            continue
        idx = blocks.index_of(name) if blocks else None
        rule = next(((i, r) for i, r in enumerate(mods.overrides) if _matches(name, r.match)), None)
        excl = next((p for p in mods.exclude if _matches(name, p)), None)
        shared = [o for _, pname, _ in _gemm_weights(m, kind) for o in owners.get(id(getattr(m, pname)), [])
                  if o != f"{name}.{pname}"]
        if isinstance(m, FP4Module):
            fp4, reason = True, f"already {type(m).__name__}"
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
        elif (blocker := _blocker(m, kind, recipe)) is not None:
            fp4, reason = False, blocker
        else:
            fp4, reason = True, "converted" + (f" (modules.overrides[{rule[0]}] {rule[1].match!r} -> fp4)"
                                               if rule is not None else "")
            n_out = m.out_features if kind == "Linear" else None
            if kind == "Linear" and n_out in vocab and idx is None:
                reason += (f" (note: out_features equals the vocabulary of {vocab[n_out]!r}: if this is the LM head, "
                           f"add {name!r} to modules.exclude)")
                report.notes.append(f"{name} looks like an LM head and was quantized: no exclude pattern matched it")
            {"Linear": NVFP4Linear, "Conv1D": FP4Conv1D, "experts": FP4Experts}[kind].convert(m, recipe)
        for label, pname, (e, n_out, n_in) in _gemm_weights(m, kind):
            transposed = kind == "Conv1D" or (kind == "experts" and bool(getattr(m, "is_transposed", False)))
            report.layers.append(LayerDecision(label(name), n_in, n_out, _numel(getattr(m, pname)), fp4, reason,
                                               kind=kind, experts=e, transposed=transposed))

    _fuse(model, report, mods.fuse)
    fp4_ids = {id(p) for m in model.modules() if isinstance(m, FP4Module) for _, p, _ in m.fp4_weights()}
    for p in {id(p): p for p in model.parameters()}.values():
        if id(p) in fp4_ids:
            report.fp4_params += _numel(p)
        else:
            report.bf16_params += _numel(p)
    log.debug("%s", report.table())  # ds_nvfp4.initialize shows it (rank 0, visibly); see engine.announce
    return report
