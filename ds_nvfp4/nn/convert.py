"""`convert_model`: turn the model's GEMM modules FP4 in place, and say why for each one that is not.

GEMM modules it knows: ``nn.Linear`` (-> ``NVFP4Linear``), GPT-2-style ``Conv1D`` (nn/conv1d.py) and MoE experts
found by what they are (nn/moe.py: any parameter holding several experts' matrices, any list of per-expert
modules), run as grouped FP4 GEMMs (nn/experts.py) or through their own forward (nn/intercept.py). Routers, found by
their role (the ``[E, H]`` GEMM beside E experts), stay BF16. Every floating parameter of two or more dimensions is
accounted for in the report: an FP4 or BF16 GEMM weight with its reason, a router, an embedding table, a
convolution kernel, or a row ``unknown: kept BF16`` that the start-up line counts.
"""

from __future__ import annotations

import fnmatch
import logging

from torch import nn

from ..config import PrecisionConfig
from ..kernels import Selection, select
from .blocks import Blocks, find_blocks
from .conv1d import FP4Conv1D, conv1d_blocker, is_conv1d
from .experts import FP4Experts, experts_blocker, gemm_shape
from .intercept import FP4InterceptedExperts
from .linear import NVFP4Linear
from .module import FP4Module
from .moe import ExpertsSite, MoEStructure, find_moe, shape_of
from .recipe import Recipe
from .report import ConversionReport, LayerDecision
from .weights import FusedGroup

log = logging.getLogger("ds_nvfp4")


def _numel(p: nn.Parameter) -> int:
    """Full element count, also for ZeRO-3 partitioned parameters (whose local numel is 0)."""
    return int(getattr(p, "ds_numel", p.numel()))


def _kind(name: str, m: nn.Module, moe: MoEStructure) -> str | None:
    """The GEMM kind of a module ("Linear", "Conv1D", "experts", "router"), None when it is none of them."""
    if name in moe.routers:
        return "router"
    site = moe.site_of(name)
    if site is not None and site.execution != "linears":
        return "experts"
    if isinstance(m, FP4Module):
        return m.kind
    if isinstance(m, nn.Linear):
        return "Linear"
    if is_conv1d(m):
        return "Conv1D"
    return None


def _matches(name: str, pattern: str) -> bool:
    """fnmatch against the full dotted name or any dotted suffix of it ("lm_head" matches "model.lm_head")."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def _transposed(m: nn.Module, site: ExpertsSite) -> dict[str, bool | None]:
    """Per expert weight: stored ``[E, K, N]`` (True), ``[E, N, K]`` (False) or known only at the GEMM (None)."""
    if site.execution == "interface":
        return {w.param: bool(m.is_transposed) for w in site.weights}
    return {w.param: None for w in site.weights}


def _gemm_weights(name: str, m: nn.Module, kind: str, site: ExpertsSite | None) -> list[tuple]:
    """``(report name, parameter name, (experts or None, N, K), stored transposed)`` of each GEMM weight."""
    if kind == "experts":
        transposed = _transposed(m, site)
        return [(f"{name}.{w.param}", w.param, gemm_shape(w, bool(transposed[w.param])), bool(transposed[w.param]))
                for w in site.weights]
    n_out, n_in = (m.nf, m.nx) if kind == "Conv1D" else (m.out_features, m.in_features)
    return [(name, "weight", (None, n_out, n_in), kind == "Conv1D")]


def _projections(m: nn.Module, site: ExpertsSite, pname: str) -> tuple[list[list[str]] | None, str | None]:
    """How an interface experts weight splits into the per-expert modules vLLM / TensorRT-LLM / llm-compressor
    name (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``), from the interface's declared layout (gate and
    up concatenated or interleaved along N); and its bias parameter. (None, None) outside the interface."""
    if site.execution != "interface":
        return None, None
    bias = f"{pname}_bias" if m.has_bias and hasattr(m, f"{pname}_bias") else None
    if pname == "gate_up_proj":
        halves = [["gate_proj", "first_half"], ["up_proj", "second_half"]] if getattr(m, "is_concatenated", True) else \
            [["gate_proj", "even"], ["up_proj", "odd"]]
        return halves, bias
    return [[pname, "all"]], bias


def _blocker(m: nn.Module, kind: str, recipe: Recipe, site: ExpertsSite | None) -> str | None:
    """A shape or layout reason why the module cannot run FP4 GEMMs, or None."""
    if kind == "Conv1D":
        return conv1d_blocker(m, recipe)
    if kind == "experts":
        return experts_blocker(site, recipe, _transposed(m, site))
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


def adapter_modules(model: nn.Module) -> dict[str, str]:
    """Modules that are adapters of another layer, by role: the children of a tuner layer (a module holding a
    ``base_layer``, as PEFT's LoRA, DoRA, IA3 ... layers do) other than its base layer, and their descendants.
    Name -> the tuner layer's name. They train in BF16: small, and the precision the adapter method assumes."""
    out: dict[str, str] = {}
    for name, m in model.named_modules():
        base = getattr(m, "base_layer", None)
        if not isinstance(base, nn.Module) or name in out:
            continue
        prefix = f"{name}." if name else ""
        for child, sub in m.named_modules():
            if child and sub is not base and not child.startswith("base_layer"):
                out[prefix + child] = name
    return out


def expert_layouts(model: nn.Module) -> list[LayerDecision]:
    """The rows :func:`convert_model` would record for ``model``'s 3-D experts weights (name, E, N, K, stored
    transposed, per-expert projections and bias), without converting anything: how a published checkpoint's
    per-expert tensors map onto the fused parameters (``ds-nvfp4 merge``). ``fp4`` is False: nothing was decided."""
    moe, out = find_moe(model), []
    for name, m in model.named_modules():
        if _kind(name, m, moe) != "experts":
            continue
        site = moe.site_of(name)
        for label, pname, (e, n_out, n_in), transposed in _gemm_weights(name, m, "experts", site):
            projections, bias = _projections(m, site, pname)
            out.append(LayerDecision(label, n_in, n_out, _numel(m.get_parameter(pname)), False, "not converted",
                                     kind="experts", experts=e, transposed=transposed, projections=projections,
                                     bias=bias))
    return out


def convert_model(model: nn.Module, precision: PrecisionConfig | dict, *, selection: Selection | None = None,
                  device=None, blocks: Blocks | None = None,
                  bf16_reasons: dict[str, str] | None = None) -> ConversionReport:
    """Convert ``model`` in place per ``precision.modules`` and return the report.

    Call it before ``deepspeed.initialize`` (``ds_nvfp4.initialize`` does). Parameters keep their identity, so
    optimizers, state_dict keys and ZeRO-3 partitioned parameters are unaffected. ``blocks``: the model's
    transformer blocks when :func:`find_blocks` cannot see them (a pipeline stage: engine/pipeline.py).
    ``bf16_reasons``: modules (full names) that stay BF16 whatever the rules say, with the reason (e.g. what a
    published checkpoint stores in BF16). Adapters (:func:`adapter_modules`) always stay BF16.

    Raises:
        ValueError: ``keep_first/last_blocks_bf16`` asks for blocks the model does not have.
        kernels.BackendUnavailable: ``precision.kernel`` names a backend that cannot run here.
    """
    pc = precision if isinstance(precision, PrecisionConfig) else PrecisionConfig.model_validate(precision)
    sel = selection or select(pc.kernel, device)
    recipe = Recipe.from_config(pc, sel.name)
    mods = pc.modules
    moe = find_moe(model)
    lists = {s.name for s in moe.sites if s.execution == "linears"}
    blocks = blocks or find_blocks(model, exclude=lists)
    report = ConversionReport(kernel=sel.name, kernel_reason=sel.reason + (f"; {sel.operand}" if sel.operand else ""),
                              blocks=blocks.describe() if blocks else None,
                              moe=[s.describe() for s in moe.sites])
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
    members = {m: s.name for s in moe.sites for m in s.members}
    adapters = adapter_modules(model)
    forced = bf16_reasons or {}
    accounted: set[int] = set()

    for name, m in list(model.named_modules()):
        kind = _kind(name, m, moe)
        if kind is None:
            continue
        if kind == "router":
            w = next(p for _, p in m.named_parameters(recurse=False) if len(shape_of(p)) == 2)
            shape = shape_of(w)
            report.layers.append(LayerDecision(
                name, shape[1], shape[0], _numel(w), False,
                f"router of {moe.routers[name]}: its {shape[0]} logits pick the experts, so it stays BF16 (as in "
                "every NVFP4 recipe)", kind="router"))
            accounted.add(id(w))
            continue
        site = moe.site_of(name)
        idx = blocks.index_of(name) if blocks else None
        rule = next(((i, r) for i, r in enumerate(mods.overrides) if _matches(name, r.match)), None)
        excl = next((p for p in mods.exclude if _matches(name, p)), None)
        gemms = _gemm_weights(name, m, kind, site)
        shared = [o for _, pname, _, _ in gemms for o in owners.get(id(m.get_parameter(pname)), [])
                  if o != f"{name}.{pname}"]
        if name in adapters:
            fp4, reason = False, (f"an adapter of {adapters[name]} (trained in BF16; its base layer follows the "
                                  "rules)")
        elif name in forced:
            fp4, reason = False, forced[name]
        elif isinstance(m, FP4Module):
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
        elif (blocker := _blocker(m, kind, recipe, site)) is not None:
            fp4, reason = False, blocker
        else:
            fp4, reason = True, "converted" + (f" (modules.overrides[{rule[0]}] {rule[1].match!r} -> fp4)"
                                               if rule is not None else "")
            n_out = m.out_features if kind == "Linear" else None
            if kind == "Linear" and n_out in vocab and idx is None:
                reason += (f" (note: out_features equals the vocabulary of {vocab[n_out]!r}: if this is the LM head, "
                           f"add {name!r} to modules.exclude)")
                report.notes.append(f"{name} looks like an LM head and was quantized: no exclude pattern matched it")
            if kind == "experts":
                cls = FP4Experts if site.execution == "interface" else FP4InterceptedExperts
                cls.convert(m, recipe, site)
                if site.execution == "intercepted":
                    reason += " (its own forward: GEMMs on expert slices run FP4, checked at the first forward)"
            else:
                {"Linear": NVFP4Linear, "Conv1D": FP4Conv1D}[kind].convert(m, recipe)
        owner = next((s for prefix, s in members.items() if name == prefix or name.startswith(prefix + ".")), None)
        if owner is not None:
            reason += f" (an expert of {owner})"
        for label, pname, (e, n_out, n_in), transposed in gemms:
            param = m.get_parameter(pname)
            accounted.add(id(param))
            projections, bias = _projections(m, site, pname) if kind == "experts" else (None, None)
            report.layers.append(LayerDecision(label, n_in, n_out, _numel(param), fp4, reason, kind=kind,
                                               experts=e, transposed=transposed, projections=projections,
                                               bias=bias))

    _account_rest(model, moe, accounted, report)
    _fuse(model, report, mods.fuse)
    fp4_ids = {id(p) for m in model.modules() if isinstance(m, FP4Module) for _, p, _ in m.fp4_weights()}
    for p in {id(p): p for p in model.parameters()}.values():
        if id(p) in fp4_ids:
            report.fp4_params += _numel(p)
        else:
            report.bf16_params += _numel(p)
    log.debug("%s", report.table())  # ds_nvfp4.initialize shows it (rank 0, visibly); see engine.announce
    return report


_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, getattr(nn, "RMSNorm", nn.LayerNorm))


def _account_rest(model: nn.Module, moe: MoEStructure, accounted: set[int], report: ConversionReport) -> None:
    """A row for every floating parameter of >= 2 dimensions no GEMM row holds: embedding tables and convolution
    kernels with what they are, anything else ``unknown: kept BF16`` (counted on the start-up line)."""
    seen = set(accounted)
    sites = [(s.name, s.experts) for s in moe.sites if s.execution != "linears"]
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            shape = shape_of(p)
            if id(p) in seen or not p.is_floating_point() or len(shape) < 2:
                continue
            seen.add(id(p))
            full = f"{mname}.{pname}" if mname else pname
            site = next((s for s in sites if mname == s[0] or mname.startswith(s[0] + ".")), None)
            if sum(d > 1 for d in shape) <= 1:
                kind, why = "vector", f"a vector parameter {list(shape)} (no GEMM): BF16"
            elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                kind, why = "embedding", "an embedding table (a lookup, no GEMM): BF16"
            elif site is not None and len(shape) == 2 and shape[0] == site[1]:
                kind, why = "bias", f"a per-expert vector of {site[0]} ({shape[0]} x {shape[1]}: a bias, no GEMM): BF16"
            elif isinstance(m, _NORMS) or type(m).__name__.endswith("Norm"):
                kind, why = "norm", f"a {type(m).__name__} weight (a normalization, no GEMM): BF16"
            elif isinstance(m, nn.modules.conv._ConvNd):
                kind, why = "conv", f"a {type(m).__name__} kernel (convolutions are not converted): BF16"
            else:
                kind = "unknown"
                why = "unknown: kept BF16 (" + moe.unexplained.get(
                    full, f"{type(m).__name__}.{pname} {list(shape)} is not a Linear, Conv1D, expert or router "
                          "weight ds_nvfp4 recognizes") + ")"
            report.layers.append(LayerDecision(full, shape[-1], shape[-2], _numel(p), False, why, kind=kind,
                                               experts=shape[0] if len(shape) == 3 else None))
