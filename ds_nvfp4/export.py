"""Export a DeepSpeed checkpoint of an NVFP4 run to safetensors: BF16, ModelOpt NVFP4 or compressed-tensors NVFP4.

Weights come from the FP32 master weights (DeepSpeed's ``zero_to_fp32`` reader, any ZeRO stage); which layers
are NVFP4 comes from ``<tag>/ds_nvfp4.json`` (written by ``ds_nvfp4.initialize`` next to every checkpoint). Each
NVFP4 layer is quantized exactly as training did (its ``weights.block`` and the tensor's amax); 16x16 tile scales are
written replicated over rows, i.e. as the 1x16 ``group_size: 16`` scales both formats expect. Everything else is
written in BF16. Files are written to a temporary name and renamed: an interrupted export leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .format import quantize
from .format.constants import GLOBAL_SCALE_NUMERATOR

FORMATS = ("bf16", "nvfp4-modelopt", "nvfp4-compressed-tensors")


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked (names the file or the layer)."""


def _resolve_tag(ckpt: Path, tag: str | None) -> str:
    if tag:
        return tag
    latest = ckpt / "latest"
    if not latest.exists():
        raise ExportError(f"{ckpt}: no 'latest' file; pass --tag (one of: "
                          f"{', '.join(sorted(p.name for p in ckpt.iterdir() if p.is_dir())) or 'none found'})")
    return latest.read_text().strip()


def load_run(ckpt_dir: str | os.PathLike, tag: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """FP32 master state dict and the ds_nvfp4 metadata of a checkpoint."""
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: not a directory")
    tag = _resolve_tag(ckpt, tag)
    meta_path = ckpt / tag / "ds_nvfp4.json"
    if not meta_path.exists():
        raise ExportError(f"{meta_path}: missing; this checkpoint was not written by ds_nvfp4.initialize, so which "
                          "layers are NVFP4 is unknown (export --format bf16 of a plain DeepSpeed checkpoint: use "
                          "DeepSpeed's zero_to_fp32.py)")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=tag)
    return {k: v.detach().float() for k, v in sd.items()}, json.loads(meta_path.read_text())


def nvfp4_layers(meta: dict) -> dict[str, str]:
    """``{layer name: weight block}`` of the layers trained in NVFP4."""
    block = meta["precision"]["weights"]["block"]
    return {layer["name"]: block for layer in meta["conversion"]["layers"] if layer["fp4"]}


def export(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, fmt: str, tag: str | None = None) -> dict:
    """Write ``model.safetensors`` (+ config) to ``out_dir``; returns a summary dict."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: allowed values are {', '.join(FORMATS)}")
    sd, meta = load_run(ckpt_dir, tag)
    layers = nvfp4_layers(meta)
    missing = [name for name in layers if f"{name}.weight" not in sd]
    if missing:
        raise ExportError(f"layers {missing} are NVFP4 in ds_nvfp4.json but have no weight in the checkpoint")
    tensors: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        if layer not in layers:
            tensors[key] = value.to(torch.bfloat16).contiguous()
            continue
        q = quantize(value, block=layers[layer], amax=value.abs().max())
        if fmt == "bf16":
            tensors[key] = q.dequantize(torch.bfloat16)
        elif fmt == "nvfp4-modelopt":
            tensors[key] = q.data.contiguous()
            tensors[f"{layer}.weight_scale"] = q.rowwise_scale().contiguous()
            tensors[f"{layer}.weight_scale_2"] = (q.amax / GLOBAL_SCALE_NUMERATOR).reshape(())
        else:
            tensors[f"{layer}.weight_packed"] = q.data.contiguous()
            tensors[f"{layer}.weight_scale"] = q.rowwise_scale().contiguous()
            # fp32 shape [1]: a 0-dim scalar makes compressed-tensors compute in bf16 (the format note)
            tensors[f"{layer}.weight_global_scale"] = (GLOBAL_SCALE_NUMERATOR / q.amax).reshape(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ignore = sorted({k[: -len(".weight")] for k in sd if k.endswith(".weight") and sd[k].dim() == 2} - set(layers))
    files = {"model.safetensors": None}
    if fmt == "nvfp4-modelopt":
        files["hf_quant_config.json"] = {"producer": {"name": "ds-nvfp4"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ignore,
            "note": "weights only: training used dynamic per-tensor activation amax, so no static input_scale is "
                    "written; calibrate activations (e.g. with ModelOpt) for W4A4 inference"}}
    elif fmt == "nvfp4-compressed-tensors":
        files["config.json"] = {"quantization_config": compressed_tensors_config(ignore)}
    _atomic_write(out / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    for name, content in files.items():
        if content is not None:
            _atomic_write(out / name, lambda p, c=content: p.write_text(json.dumps(c, indent=2)))
    return {"format": fmt, "nvfp4_layers": sorted(layers), "bf16_layers": ignore, "tensors": len(tensors),
            "files": sorted(files)}


def compressed_tensors_config(ignore: list[str]) -> dict:
    """The ``quantization_config`` compressed-tensors reads for NVFP4 weights (``nvfp4-pack-quantized``)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                        "symmetric": True, "dynamic": False, "observer": "minmax"},
            "input_activations": None,
        }},
        "ignore": ignore,
    }


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".partial")
    write(tmp)
    os.replace(tmp, path)
