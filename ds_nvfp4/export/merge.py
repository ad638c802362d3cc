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

from ..checkpoint.hf_nvfp4 import FUSED, load_dequantized, open_nvfp4_checkpoint
from ..format import quantize
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
    load_dequantized(model, ckpt)
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
            _write_nvfp4(tmp, merged, ckpt, fmt, summary)
        _replace_dir(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def _write_nvfp4(tmp: Path, merged: torch.nn.Module, ckpt, fmt: str, summary: MergeSummary) -> None:
    """The merged weights of the base's quantized modules re-quantized (1x16; a fused group shares the max of its
    members' amaxes), everything else BF16, in the base's layout."""
    import json

    from safetensors.torch import save_file

    state = {k: v.detach() for k, v in merged.state_dict().items()}
    amax = {m: state[f"{m}.weight"].abs().amax().float() for m in ckpt.weights}
    for m in ckpt.weights:  # one global scale per fused inference GEMM, as the base had
        parent, _, leaf = m.rpartition(".")
        for group in FUSED:
            if leaf in group:
                peers = [f"{parent}.{g}" if parent else g for g in group]
                amax[m] = max(amax[p] for p in peers if p in amax)
    tensors = {}
    for name, value in state.items():
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
