"""``precision.base``: the frozen base of a fine-tune and the published NVFP4 checkpoint it is read from
(docs/finetune.md).

Three steps inside ``ds_nvfp4.initialize``:

1. :func:`open_base`, before conversion: the checkpoint is validated from its configs and headers (an error names
   the tensor and the file), and every Linear the checkpoint stores in BF16 (its ``ignore`` / ``exclude_modules``)
   is kept BF16 by the converter with that reason.
2. :func:`prepare_base`, after conversion and before ``deepspeed.initialize``: ``frozen`` sets ``requires_grad``
   false on every converted weight (no FP32 master, no gradient, no optimizer state: DeepSpeed's ZeRO optimizers
   leave frozen parameters out); the checkpoint's other tensors (embeddings, norms, its BF16 layers) are loaded as
   stored, and the frozen weights' codes are left for the packed storage, which reads each rank's slice of them
   (``NVFP4Checkpoint.read_flat``) and multiplies them as stored. Without ``frozen`` (continued training) every
   parameter is set from the checkpoint, the quantized weights dequantized, so the masters start at its values.
3. :func:`finish_base`, after the storage is installed: a frozen weight whose partition cannot be stored packed
   (see ``zero/partition.py``) is set from its dequantized codes instead, so no weight keeps its random
   initialization.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..checkpoint.experts import expert_codes, experts_from_checkpoint
from ..checkpoint.hf_nvfp4 import (
    LoadReport,
    NVFP4Checkpoint,
    assign_parameter,
    checkpoint_name,
    load_dequantized,
    open_nvfp4_checkpoint,
)
from ..config import ConfigError, PrecisionConfig, Problem
from ..nn import ConversionReport
from ..nn.convert import adapter_modules
from ..nn.module import FP4Module
from ..nn.moe import find_moe

if TYPE_CHECKING:
    from ..zero import PackedPartitions
    from ..zero.packed import FrozenSource


@dataclass
class BasePlan:
    """What ``precision.base`` does to this model."""

    checkpoint: NVFP4Checkpoint | None
    #: GEMM modules kept BF16 because the checkpoint stores them BF16 (full module name -> reason)
    bf16_reasons: dict[str, str] = field(default_factory=dict)
    #: ``id(param)`` -> where the packed storage reads the frozen weight's codes
    sources: dict[int, FrozenSource] = field(default_factory=dict)
    #: converted weights frozen
    frozen: int = 0
    load: LoadReport | None = None
    #: 3-D experts parameters (and biases) assembled from per-expert checkpoint tensors: name -> its value, made on call
    experts: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)

    def describe_sources(self) -> str:
        if self.checkpoint is None:
            return ""
        return f"read as stored from {self.checkpoint.folder} ({self.checkpoint.format}), each rank its own slice"


def open_base(model: nn.Module, precision: PrecisionConfig) -> BasePlan | None:
    """Step 1 (module docstring); None when ``precision.base`` asks for nothing."""
    base = precision.base
    if not base.frozen and not base.checkpoint:
        return None
    if not base.checkpoint:
        return BasePlan(None)
    ckpt = open_nvfp4_checkpoint(base.checkpoint)
    sites = find_moe(model).sites
    adapters = adapter_modules(model)
    ignored = set(ckpt.ignore)
    reasons = {}
    for name, m in model.named_modules():
        stored = checkpoint_name(name)
        if isinstance(m, nn.Linear) and name not in adapters and stored not in ckpt.weights:
            why = "in its ignore list" if stored in ignored else "not quantized there"
            reasons[name] = f"the checkpoint stores it BF16 ({why}): kept BF16 as published"
    for site in sites:  # fused experts whose per-expert tensors the checkpoint keeps BF16
        prefix = f"{checkpoint_name(site.name)}.0."
        if site.execution != "linears" and not any(m.startswith(prefix) for m in ckpt.weights) and any(
                t.startswith(prefix) and t.endswith(".weight") for t in ckpt.tensors):
            reasons[site.name] = "the checkpoint stores its experts BF16: kept BF16 as published"
    return BasePlan(ckpt, reasons)


def prepare_base(model: nn.Module, plan: BasePlan, precision: PrecisionConfig, conversion: ConversionReport) -> None:
    """Step 2 (module docstring)."""
    if plan.checkpoint is not None:
        _check_experts_mapped(plan.checkpoint, conversion)
    layers = [m for m in model.modules() if isinstance(m, FP4Module)]
    weights = {id(p): p for m in layers for _, p, _ in m.fp4_weights()}
    names = {id(p): n for n, p in model.named_parameters()}
    if precision.base.frozen:
        for p in weights.values():
            p.requires_grad_(False)
        plan.frozen = len(weights)
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError([Problem("precision.base.frozen", "true, but then no parameter of the model trains: "
                                                                "add adapters before ds_nvfp4.initialize (PEFT: "
                                                                "get_peft_model(model, LoraConfig(...))), or set "
                                                                "precision.base.frozen false")])
        trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)
        conversion.notes.append(f"precision.base.frozen: {plan.frozen} converted weights frozen (no FP32 master, "
                                f"no optimizer state); {trainable:,} parameters train")
    ckpt = plan.checkpoint
    if ckpt is None:
        return
    adapters = adapter_modules(model)
    new = frozenset(f"{m}.{p}" for m in adapters for p, _ in model.get_submodule(m).named_parameters(recurse=False))
    plan.experts = experts_from_checkpoint(ckpt, conversion.layers, model)
    packed = set()
    if precision.base.frozen:
        decisions = {d.name: d for d in conversion.layers if d.kind == "experts"}
        for pid in weights:
            name = names[pid]
            module = checkpoint_name(name).removesuffix(".weight")
            if name in plan.experts:  # left to the packed storage, which reads each rank's range of the codes
                plan.sources[pid] = _expert_source(ckpt, decisions[name])
                packed.add(name)
            elif module in ckpt.weights:
                packed.add(name)
                plan.sources[pid] = functools.partial(ckpt.read_flat, module)
    plan.load = load_dequantized(model, ckpt, packed=frozenset(packed), new=new, experts=plan.experts)
    conversion.notes.append(f"precision.base.checkpoint {ckpt.folder} ({ckpt.format}): {plan.load.summary()}")


def _check_experts_mapped(ckpt: NVFP4Checkpoint, conversion: ConversionReport) -> None:
    """An experts weight the checkpoint stores under per-expert names must have the rows each expert's projections
    fill recorded by the conversion (transformers' experts interface); otherwise an error naming it, before any
    parameter changes."""
    for d in conversion.layers:
        if d.kind != "experts" or d.projections:
            continue
        site = checkpoint_name(d.name.rpartition(".")[0])
        if not any(t.startswith(f"{site}.0.") for t in ckpt.tensors):
            continue  # stored under the parameter's own name, or not at all (load_dequantized says which)
        wrapped = ".base_layer." in d.name
        why = ("PEFT wraps it (LoRA on the experts' parameters: target_modules gate_proj / up_proj / down_proj reach "
               "transformers' fused experts through PEFT's ParamWrapper), which adds the adapter's delta to the "
               "weight before every expert GEMM, so the stored codes cannot be multiplied as stored: target the "
               "attention and dense projections only (e.g. target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']) "
               "or leave the experts out of target_modules" if wrapped else
               "the converter runs this experts module through its own forward, so it does not know which rows of "
               f"the parameter each of the checkpoint's per-expert tensors ({site}.0.*) fills")
        raise ConfigError([Problem("precision.base.checkpoint", f"{ckpt.folder} stores {checkpoint_name(d.name)} "
                                                                f"per expert, but {d.name} cannot take it: {why}")])


def _expert_source(ckpt: NVFP4Checkpoint, d) -> FrozenSource:
    """Where the packed storage reads a frozen 3-D experts weight's codes: the per-expert checkpoint tensors in the
    rows the conversion recorded. Refused (naming the parameter) where the parameter is stored ``[E, K, N]``: its
    blocks would run along N, the checkpoint's run along K, so the stored codes cannot be taken as they are."""
    if d.transposed:
        raise ConfigError([Problem("precision.base.frozen", f"{d.name} stores its experts transposed ([E, K, N]), so "
                                                            "the checkpoint's 1x16 blocks (along K) cannot be packed "
                                                            "into its partitions as stored; set precision.base.frozen "
                                                            "false (continued training loads it dequantized)")])
    return expert_codes(ckpt, d)


def finish_base(plan: BasePlan, engine, store: PackedPartitions | None) -> None:
    """Step 3 (module docstring)."""
    ckpt = plan.checkpoint
    if ckpt is None:
        return
    if store is not None:
        for e in store.frozen:
            if not e.packable and id(e.param) in plan.sources:
                experts = plan.experts.get(e.name)
                module = checkpoint_name(e.name).removesuffix(".weight")
                assign_parameter(e.param, experts() if experts is not None else ckpt.read(module).dequantize())
    if plan.frozen:
        return
    # continued training: DeepSpeed made the FP32 masters from the BF16 parameters, i.e. the dequantized weights
    # rounded to BF16; set them to the dequantized codes themselves (each ZeRO-3 rank its own element range)
    from deepspeed import comm as dist
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

    for name, p in engine.module.named_parameters():
        module = checkpoint_name(name).removesuffix(".weight")
        experts = plan.experts.get(name)
        if not p.requires_grad or (experts is None and (not name.endswith(".weight") or module not in ckpt.weights)):
            continue
        if hasattr(p, "ds_id"):
            n, total = int(p.partition_numel()), int(p.ds_numel)
            rank = dist.get_rank(group=p.ds_process_group)
            start, stop = min(rank * n, total), min((rank + 1) * n, total)
            local = torch.zeros(n, dtype=torch.float32)
            local[: stop - start] = (experts().reshape(-1)[start:stop] if experts is not None
                                     else ckpt.dequantize_flat(module, start, stop))
            if store is not None and id(p) in store.entries and not store.entries[id(p)].frozen:
                store.set_master(p, local)
            else:
                safe_set_local_fp32_param(p, local)
        else:
            safe_set_full_fp32_param(p, experts() if experts is not None
                                     else ckpt.read(module).dequantize(torch.float32).view(p.shape))
    if store is not None and store.packed:
        store.pack_all()  # the packed partitions derive from the masters
        store.refresh_persistent()
