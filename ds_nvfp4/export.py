"""Export a DeepSpeed checkpoint of an NVFP4 run: BF16, ModelOpt NVFP4 or compressed-tensors NVFP4 safetensors.

Input: a checkpoint folder with a ``latest`` file and tag sub-folders (``launch/train.py``'s ``ckpt/``, or a Hugging
Face Trainer ``checkpoint-N`` folder, which also holds the model's ``config.json`` and tokenizer files). Which
layers are NVFP4, the fused groups and the activations' amaxes come from ``<tag>/ds_nvfp4.json`` (written by
``ds_nvfp4.initialize`` next to every checkpoint).

The codes are the ones training computed with: each NVFP4 weight is quantized from what the training forward
quantized (the FP32 master where ZeRO-3 stored it packed, its BF16 copy otherwise: ZeRO-0/1/2, BF16 storage, or a
partition that cuts 16x16 tiles, listed as ``stored_bf16``) with the same amax (the fused
group's when training shared one), so the bits equal the weights the forward saw (tested against
``GatheredParameters``). A fused group that training could not share (ZeRO-3 with BF16 storage) is re-quantized
with one global scale, and the summary says so. 16x16 tile scales are written replicated over rows, i.e. as the
1x16 ``group_size: 16`` scales both formats expect.

W4A4 (``quant_algo: "NVFP4"`` / compressed-tensors ``input_activations``) is declared when training recorded every
NVFP4 layer's input amax (the static activation scale); otherwise W4A16 (weights only), with the reason.

The output is written to a temporary folder beside ``OUT`` and renamed into place: an interrupted export leaves
nothing half-written, and ``force=True`` replaces an existing ``OUT`` whole (no stale file survives).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint.metadata import FILE as CHECKPOINT_META
from .checkpoint.metadata import CheckpointError, CheckpointMetadata, read_metadata
from .format import quantize
from .format.constants import GLOBAL_SCALE_NUMERATOR
from .nn.fused import groups_by_name, share_amax

FORMATS = ("bf16", "nvfp4-modelopt", "nvfp4-compressed-tensors")
#: Hugging Face files copied from the checkpoint folder when present (model config handled separately)
HF_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked (names the file, the tag or the layer)."""


@dataclass
class ExportSummary:
    format: str
    nvfp4_layers: list[str]
    bf16_layers: list[str]
    tensors: int
    files: list[str]
    scheme: str                                   # "W4A4", "W4A16" or "BF16"
    scheme_reason: str = ""
    fused_groups: list[list[str]] = field(default_factory=list)
    requantized: list[str] = field(default_factory=list)     # fused groups re-quantized with a shared scale
    hf_model: bool = False                        # config.json with architectures/model_type written

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def checkpoint_tags(ckpt: Path) -> list[str]:
    """Tag folders of a DeepSpeed checkpoint (those holding model states)."""
    return sorted(p.name for p in ckpt.iterdir() if p.is_dir() and any(p.glob("*model_states.pt")))


def _resolve_tag(ckpt: Path, tag: str | None) -> str:
    tags = checkpoint_tags(ckpt)
    listing = ", ".join(tags) or "none found"
    if tag:
        if tag not in tags:
            raise ExportError(f"{ckpt}: no checkpoint tag {tag!r} (tags here: {listing})")
        return tag
    latest = ckpt / "latest"
    if not latest.exists():
        raise ExportError(f"{ckpt}: no 'latest' file; pass --tag (tags here: {listing})")
    return latest.read_text().strip()


def load_run(ckpt_dir: str | os.PathLike, tag: str | None = None
             ) -> tuple[dict[str, torch.Tensor], CheckpointMetadata]:
    """FP32 master state dict (HF/module parameter names) and the ds_nvfp4 metadata of a checkpoint."""
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: not a directory (expected a DeepSpeed checkpoint folder with a 'latest' file)")
    tag = _resolve_tag(ckpt, tag)
    meta_path = ckpt / tag / CHECKPOINT_META
    if not meta_path.exists():
        raise ExportError(f"{meta_path}: missing; checkpoint tag {tag!r} was not saved by an engine from "
                          "ds_nvfp4.initialize (or by deepspeed.initialize with a precision section), so which "
                          "layers are NVFP4 is unknown (for BF16 weights of a plain DeepSpeed checkpoint use "
                          "DeepSpeed's zero_to_fp32.py)")
    try:
        meta = read_metadata(meta_path)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=tag)
    return {k: v.detach().float() for k, v in sd.items()}, meta


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


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is a file, not a directory; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out}: exists and is not empty; pass --force to replace it whole (stale files of "
                          "another format beside a new export make inference engines pick the wrong one)")


def export(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, fmt: str, tag: str | None = None, *,
           force: bool = False, weight_only: bool = False) -> ExportSummary:
    """Write an export of checkpoint ``ckpt_dir`` to ``out_dir`` (see the module docstring)."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: allowed values are {', '.join(FORMATS)}")
    out = Path(out_dir)
    _check_out(out, force)
    ckpt = Path(ckpt_dir)
    sd, meta = load_run(ckpt, tag)
    layers = meta.nvfp4_layers()
    missing = [name for name in layers if f"{name}.weight" not in sd]
    if missing:
        raise ExportError(f"layers {missing} are NVFP4 in {CHECKPOINT_META} but have no weight in the checkpoint")
    if fmt != "bf16" and layers and meta.activation_hadamard:
        raise ExportError("precision.activations.hadamard was on: the forward multiplied Hadamard-rotated weight "
                          "codes, which no inference engine applies; export --format bf16 instead")

    # what the training forward quantized: packed ZeRO-3 storage re-packs from the FP32 master; otherwise the
    # forward reads the BF16 module weight
    from_master = set(layers) - set(meta.stored_bf16) if meta.stored_packed else set()
    source = {n: sd[f"{n}.weight"] if n in from_master else sd[f"{n}.weight"].to(torch.bfloat16).float()
              for n in layers}
    trained_groups = [sorted(g) for g in meta.conversion.fused_groups]
    groups = export_groups(sorted(layers), meta.fuse_rules)
    names = list(source)
    shared = share_amax(torch.stack([w.abs().max() for w in source.values()]), groups_by_name(names, groups))
    amax = dict(zip(names, shared))
    requantized = [", ".join(g) for g in groups if sorted(g) not in trained_groups]

    input_amax = meta.input_amax
    scheme, reason = "BF16", "--format bf16"
    if fmt != "bf16":
        bad = [n for n in layers if not (isinstance(input_amax.get(n), (int, float))
                                        and math.isfinite(input_amax[n]) and input_amax[n] > 0)]
        if weight_only:
            scheme, reason = "W4A16", "--weight-only"
        elif bad:
            scheme, reason = "W4A16", (f"no finite input amax recorded for {len(bad)} layers (e.g. {bad[0]}): "
                                       "checkpoints from before ds-nvfp4 recorded them, or the layer never ran")
        else:
            scheme, reason = "W4A4", "input amaxes recorded by training (max over ranks and steps)"
        for g in groups:
            if scheme == "W4A4":  # one input scale per fused GEMM (its members read the same input anyway)
                shared_in = max(input_amax[n] for n in g)
                input_amax = {**input_amax, **dict.fromkeys(g, shared_in)}

    tensors: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        if layer not in layers:
            tensors[key] = value.to(torch.bfloat16).contiguous()
            continue
        q = quantize(source[layer], block=layers[layer], amax=amax[layer])
        if fmt == "bf16":
            tensors[key] = q.dequantize(torch.bfloat16)
        elif fmt == "nvfp4-modelopt":
            tensors[key] = q.data.contiguous()
            tensors[f"{layer}.weight_scale"] = q.rowwise_scale().contiguous()
            tensors[f"{layer}.weight_scale_2"] = (q.amax / GLOBAL_SCALE_NUMERATOR).reshape(())
            if scheme == "W4A4":
                tensors[f"{layer}.input_scale"] = torch.tensor(input_amax[layer] / GLOBAL_SCALE_NUMERATOR)
        else:
            tensors[f"{layer}.weight_packed"] = q.data.contiguous()
            tensors[f"{layer}.weight_scale"] = q.rowwise_scale().contiguous()
            # fp32 shape [1], the divisor form (compressed-tensors / vLLM take its reciprocal)
            tensors[f"{layer}.weight_global_scale"] = (GLOBAL_SCALE_NUMERATOR / q.amax).reshape(1)
            if scheme == "W4A4":
                tensors[f"{layer}.input_global_scale"] = torch.tensor([GLOBAL_SCALE_NUMERATOR / input_amax[layer]])

    ignore = sorted({k[: -len(".weight")] for k in sd if k.endswith(".weight") and sd[k].dim() == 2} - set(layers))
    files: dict[str, dict | None] = {"model.safetensors": None}
    hf_config = _hf_config(ckpt)
    if fmt == "nvfp4-modelopt":
        files["hf_quant_config.json"] = modelopt_config(ignore, scheme)
    if hf_config is not None:
        hf_config["torch_dtype"] = "bfloat16"  # transformers' forward needs the training dtype (integrations note)
        hf_config["dtype"] = "bfloat16"
        if fmt == "nvfp4-compressed-tensors":
            hf_config["quantization_config"] = compressed_tensors_config(ignore, scheme)
        else:
            hf_config.pop("quantization_config", None)
        files["config.json"] = hf_config
    elif fmt == "nvfp4-compressed-tensors":  # not an HF model: the quantization config alone, as before
        files["config.json"] = {"quantization_config": compressed_tensors_config(ignore, scheme)}

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, content in files.items():
            if content is not None:
                (tmp / name).write_text(json.dumps(content, indent=2))
        for name in HF_FILES if hf_config is not None else ():
            if (ckpt / name).is_file():
                shutil.copy2(ckpt / name, tmp / name)
                files[name] = None
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportSummary(fmt, sorted(layers), ignore, len(tensors), sorted(files), scheme, reason, groups,
                         requantized, hf_config is not None)


def _hf_config(ckpt: Path) -> dict | None:
    """The model's Hugging Face ``config.json`` saved beside the DeepSpeed tags (HF Trainer does), if any."""
    path = ckpt / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    if not cfg.get("architectures") or not cfg.get("model_type"):
        raise ExportError(f"{path}: has no 'architectures' or 'model_type'; transformers and vLLM need both")
    return cfg


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished export into place; an existing ``out`` (checked empty or ``--force``) goes whole."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def compressed_tensors_config(ignore: list[str], scheme: str = "W4A16") -> dict:
    """The ``quantization_config`` compressed-tensors (and vLLM's compressed-tensors schemes) read for NVFP4."""
    args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
            "observer": "minmax"}
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**args, "dynamic": False},
            # W4A4: per-16 block scales computed at run time ("local"), the per-tensor input_global_scale static
            "input_activations": {**args, "dynamic": "local"} if scheme == "W4A4" else None,
        }},
        "ignore": ignore,
    }


def modelopt_config(ignore: list[str], scheme: str) -> dict:
    """``hf_quant_config.json`` as vLLM (``modelopt.py``) and TensorRT-LLM read it.

    ``producer.name`` must be ``"modelopt"``: vLLM selects its ModelOpt path by that name only. The layout is
    ModelOpt's unified HF format; ``ds_nvfp4`` records who wrote it.
    """
    from . import __version__

    return {"producer": {"name": "modelopt", "version": "unified-hf"},
            "quantization": {"quant_algo": "NVFP4" if scheme == "W4A4" else "W4A16_NVFP4",
                             "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ignore},
            "ds_nvfp4": {"version": __version__, "scheme": scheme}}

