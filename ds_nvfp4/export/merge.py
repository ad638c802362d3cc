"""`ds-nvfp4 merge BASE ADAPTER OUT --format ...`: LoRA adapters (PEFT's format) trained on a frozen NVFP4 base,
merged into one model folder for serving.

The base's quantized weights are dequantized from their stored codes (``load_dequantized``), PEFT merges the
adapters in FP32 (``W + scaling * B @ A``), and the merged model is written as BF16 (transformers'
``save_pretrained``; every weight exactly the FP32 merge rounded to BF16) or re-quantized NVFP4 in either published
layout (1x16 blocks, one global scale per fused inference GEMM: q/k/v, gate/up), with the base's BF16 modules
(its ``ignore`` / ``exclude_modules``) kept BF16. Written to a temporary folder and renamed into place: never half
a folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.experts import PROJECTION_ROWS, experts_from_checkpoint
from ..checkpoint.hf_nvfp4 import FUSED, checkpoint_name, load_dequantized, open_nvfp4_checkpoint
from ..format import quantize
from ..nn.convert import expert_layouts
from ..nn.report import LayerDecision
from .formats import compressed_tensors_config, modelopt_config, nvfp4_tensors
from .writer import ExportError, _replace_dir, check_out

MERGE_FORMATS = ("bf16", "nvfp4-compressed-tensors", "nvfp4-modelopt")


@dataclass
class MergeSummary:
    format: str
    adapters: int                     # LoRA-adapted layers merged
    nvfp4_layers: list[str] = field(default_factory=list)
    bf16_layers: list[str] = field(default_factory=list)


def merge(base: str | os.PathLike, adapter: str | os.PathLike, out_dir: str | os.PathLike, fmt: str, *,
          force: bool = False) -> MergeSummary:
    """Merge ``adapter`` into the NVFP4 checkpoint ``base`` and write ``out_dir`` in ``fmt`` (MERGE_FORMATS).

    Raises:
        ExportError: a bad argument (the folder and what is wrong); nothing written.
        CheckpointError: ``base`` is not a valid NVFP4 checkpoint (names the tensor and the file).
    """
    if fmt not in MERGE_FORMATS:
        raise ExportError(f"--format {fmt!r}: allowed {', '.join(MERGE_FORMATS)}")
    out, adapter = Path(out_dir), Path(adapter)
    check_out(out, force)
    if not (adapter / "adapter_config.json").is_file():
        raise ExportError(f"{adapter}: no adapter_config.json: not a PEFT adapter folder (trainer.save_model or "
                          "PeftModel.save_pretrained writes one)")
    ckpt = open_nvfp4_checkpoint(base)
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the merged model is a new one: BF16, or quantized again below
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layouts = expert_layouts(model)
    experts = experts_from_checkpoint(ckpt, layouts, model)  # MoE: per-expert tensors into the fused parameters
    load_dequantized(model, ckpt, experts=experts)
    peft_model = PeftModel.from_pretrained(model, str(adapter))
    adapted = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    merged = peft_model.merge_and_unload()
    summary = MergeSummary(fmt, adapted)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=False)
    try:
        if fmt == "bf16":
            merged.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
            summary.bf16_layers = sorted(ckpt.weights)
        else:
            _write_nvfp4(tmp, merged, ckpt, fmt, summary, {d.name: d for d in layouts if d.name in experts})
        _replace_dir(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def _write_nvfp4(tmp: Path, merged: torch.nn.Module, ckpt, fmt: str, summary: MergeSummary,
                 experts: dict[str, LayerDecision]) -> None:
    """The merged weights of the base's quantized modules re-quantized (1x16; a fused group shares the max of its
    members' amaxes), everything else BF16, in the base's layout; ``experts``: the fused experts parameters the base
    stores per expert, written back under its per-expert names (each expert's gate and up share one global
    scale)."""
    import json

    from safetensors.torch import save_file

    state = {k: v.detach() for k, v in merged.state_dict().items()}
    # the per-expert modules of a MoE base are written from their fused parameters by _write_experts
    amax = {m: state[f"{m}.weight"].abs().amax().float() for m in ckpt.weights if f"{m}.weight" in state}
    for m in list(amax):  # one global scale per fused inference GEMM, as the base had
        parent, _, leaf = m.rpartition(".")
        for group in FUSED:
            if leaf in group:
                peers = [f"{parent}.{g}" if parent else g for g in group]
                amax[m] = max(amax[p] for p in peers if p in amax)
    tensors = {}
    biases = {f"{d.name.rpartition('.')[0]}.{d.bias}": d for d in experts.values() if d.bias}
    for name, value in state.items():
        if name in experts or name in biases:
            _write_experts(tensors, value, experts.get(name) or biases[name], ckpt, fmt, name in biases, summary)
            continue
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in ckpt.weights:
            q = quantize(value.float(), block="1x16", amax=amax[module])
            tensors |= nvfp4_tensors(fmt, module, q, slice(None), None)
            summary.nvfp4_layers.append(module)
        else:
            tensors[name] = value.to(torch.bfloat16).contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = merged.config.to_dict()
    ignore = list(ckpt.ignore)
    if fmt == "nvfp4-modelopt":
        (tmp / "hf_quant_config.json").write_text(json.dumps(modelopt_config(ignore, "W4A16"), indent=2))
    else:
        config["quantization_config"] = compressed_tensors_config(ignore)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    summary.bf16_layers = ignore


def _write_experts(tensors: dict, value: torch.Tensor, d: LayerDecision, ckpt, fmt: str, bias: bool,
                   summary: MergeSummary) -> None:
    """One fused experts parameter (``[E, N, K]``, ``[E, K, N]`` transposed) or its bias ``[E, N]`` under the base's
    per-expert names: NVFP4 where the base stores them NVFP4 (one quantization per expert matrix), else BF16."""
    site = checkpoint_name(d.name.rpartition(".")[0])
    for e in range(d.experts):
        mat = value[e] if bias or not d.transposed else value[e].t()
        q = None if bias else quantize(mat.float().contiguous(), block="1x16")
        for proj, rows in d.projections:
            module, sel = f"{site}.{e}.{proj}", PROJECTION_ROWS[rows](d.out_features)
            if bias:
                tensors[f"{module}.bias"] = mat[sel].to(torch.bfloat16).contiguous()
            elif module in ckpt.weights:
                tensors |= nvfp4_tensors(fmt, module, q, sel, None)
                summary.nvfp4_layers.append(module)
            else:
                tensors[f"{module}.weight"] = mat[sel].to(torch.bfloat16).contiguous()
