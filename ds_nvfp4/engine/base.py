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
from ..nn.report import PROJECTION_ROWS

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
    if sites and base.frozen:
        raise ConfigError([Problem("precision.base.checkpoint", f"the model has MoE experts ({sites[0].name}, ...): "
                                                                "a frozen NVFP4 MoE base packed from the checkpoint's "
                                                                "per-expert codes is not supported yet; continued "
                                                                "training (base.frozen false) loads it "
                                                                "(docs/finetune.md, 'Not built yet')")])
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
    packed = set()
    if precision.base.frozen:
        for pid in weights:
            module = checkpoint_name(names[pid]).removesuffix(".weight")
            if module in ckpt.weights:
                packed.add(names[pid])
                plan.sources[pid] = functools.partial(ckpt.read_flat, module)
    plan.experts = _experts_from_checkpoint(ckpt, conversion, model)
    plan.load = load_dequantized(model, ckpt, packed=frozenset(packed), new=new | frozenset(plan.experts))
    for name, value in plan.experts.items():  # transformers' fused expert parameters, from the per-expert tensors
        assign_parameter(model.get_parameter(name), value())
        plan.load.new.remove(name)
        plan.load.from_codes.append(name)
    conversion.notes.append(f"precision.base.checkpoint {ckpt.folder} ({ckpt.format}): {plan.load.summary()}")


def _experts_from_checkpoint(ckpt: NVFP4Checkpoint, conversion: ConversionReport,
                             model: nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    """Each 3-D experts parameter (and its per-expert bias) of the model assembled from the checkpoint's per-expert
    modules (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, as ``ds-nvfp4 export``, vLLM and llm-compressor
    name them): quantized ones dequantized from their codes, BF16 ones as stored, each in the rows the conversion
    recorded (``LayerDecision.projections``), transposed back where the parameter is stored ``[E, K, N]``. Each value
    is made when called (float32, the whole parameter): once to load it, once more for the FP32 masters."""
    out: dict[str, Callable[[], torch.Tensor]] = {}
    params = dict(model.named_parameters())
    for d in conversion.layers:
        if d.kind != "experts" or not d.projections or d.name not in params:
            continue
        site = checkpoint_name(d.name.rpartition(".")[0])
        if not any(f"{site}.0.{proj}" in ckpt.weights or f"{site}.0.{proj}.weight" in ckpt.tensors
                   for proj, _ in d.projections):
            continue  # the checkpoint stores this parameter under its own name (load_dequantized takes it)
        out[d.name] = functools.partial(_assemble, ckpt, d, site, False)
        if d.bias:
            out[f"{d.name.rpartition('.')[0]}.{d.bias}"] = functools.partial(_assemble, ckpt, d, site, True)
    return out


def _assemble(ckpt: NVFP4Checkpoint, d, site: str, bias: bool) -> torch.Tensor:
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


def finish_base(plan: BasePlan, engine, store: PackedPartitions | None) -> None:
    """Step 3 (module docstring)."""
    ckpt = plan.checkpoint
    if ckpt is None:
        return
    if store is not None:
        for e in store.frozen:
            if not e.packable and id(e.param) in plan.sources:
                module = checkpoint_name(e.name).removesuffix(".weight")
                assign_parameter(e.param, ckpt.read(module).dequantize())
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
