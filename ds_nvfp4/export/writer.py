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

from ..checkpoint.metadata import CheckpointError
from ..checkpoint.reader import load_run
from ..format import quantize
from .formats import FORMATS, compressed_tensors_config, modelopt_config, nvfp4_tensors
from .units import ExportError, plan

#: Hugging Face files copied from the checkpoint folder when present (model config handled separately)
HF_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


@dataclass
class ExportSummary:
    format: str
    nvfp4_layers: list[str]      # the output modules written NVFP4 (per-expert names for MoE experts)
    bf16_layers: list[str]       # the GEMM modules training kept BF16 (what ``ignore`` lists)
    tensors: int
    files: list[str]
    scheme: str                                   # "W4A4", "W4A16" or "BF16"
    scheme_reason: str = ""
    fused_groups: list[list[str]] = field(default_factory=list)
    requantized: list[str] = field(default_factory=list)     # fused groups re-quantized with a shared scale
    hf_model: bool = False                        # config.json with architectures/model_type written
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def check_out(out: Path, force: bool) -> None:
    """OUT must be (or become) a directory: checked before anything is read."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is a file, not a directory; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out}: exists and is not empty; pass --force to replace it whole (stale files of "
                          "another format beside a new export make inference engines pick the wrong one)")
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"{out}: {parent} is a file, so no directory can be made there")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"{out}: {parent} is not writable")


def export(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, fmt: str, tag: str | None = None, *,
           force: bool = False, weight_only: bool = False) -> ExportSummary:
    """Write an export of checkpoint ``ckpt_dir`` to ``out_dir`` (see the module docstring)."""

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: allowed values are {', '.join(FORMATS)}")
    out = Path(out_dir)
    check_out(out, force)
    ckpt = Path(ckpt_dir)
    try:
        sd, meta = load_run(ckpt, tag)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    units, rest, kept, groups, requantized = plan(sd, meta)
    if fmt != "bf16" and not units:
        raise ExportError(f"{ckpt}: no layer was trained in NVFP4, so an NVFP4 export would declare a quantization "
                          "of nothing; use --format bf16")
    if fmt != "bf16" and meta.activation_hadamard:
        raise ExportError("precision.activations.hadamard was on: the forward multiplied Hadamard-rotated weight "
                          "codes, which no inference engine applies; export --format bf16 instead")
    unnamed = sorted({u.param for u in units if not u.outputs})
    if unnamed and fmt != "bf16":
        raise ExportError(f"{', '.join(unnamed[:3])}: experts run through their own forward (no declared per-expert "
                          "layout), so ds_nvfp4 does not know the per-expert names an NVFP4 loader reads for them; "
                          "export --format bf16 (docs/moe.md lists the families)")
    if unnamed and meta.weight_block != "16x16":
        raise ExportError(f"{', '.join(unnamed[:3])}: experts run through their own forward were trained with 1x16 "
                          "weight blocks along a K only their forward knows; their weights cannot be re-quantized "
                          "exactly here (16x16 tiles can)")
    scheme, reason = _scheme(fmt, units, groups, weight_only)
    tensors: dict[str, torch.Tensor] = {k: v.to(torch.bfloat16).contiguous() for k, v in rest.items()}
    written: list[str] = []
    dequantized: dict[str, torch.Tensor] = {}  # BF16: state-dict key -> the forward's weight in its stored layout
    for u in units:
        q = quantize(u.source, block=meta.weight_block, amax=u.amax, scaling=meta.weight_scaling)
        if fmt == "bf16":
            w = q.dequantize(torch.bfloat16)
            w = w.t() if u.kn else w
            if u.index is None:
                dequantized[u.param] = w.contiguous()
            else:
                dequantized.setdefault(u.param, torch.empty(sd[u.param].shape, dtype=torch.bfloat16)) \
                    .view(-1, *w.shape)[u.index] = w
        for name, rows in u.outputs:
            written.append(name)
            if fmt == "bf16":
                w = q.dequantize(torch.bfloat16)[rows]
                tensors[f"{name}.weight"] = (w.t() if u.kn and u.index is None else w).contiguous()
            else:
                tensors.update(nvfp4_tensors(fmt, name, q, rows, u.input_amax if scheme == "W4A4" else None))
    for key in unnamed:  # not an HF model: the parameter under its own name
        tensors[key] = dequantized[key]
    notes = []
    if fmt != "bf16" and any(u.kn for u in units):
        notes.append("Conv1D layers are written in the [out, in] layout NVFP4 loaders read (vLLM's GPT-2); "
                     "transformers' compressed-tensors integration quantizes nn.Linear only, so load this model "
                     "in transformers from a --format bf16 export")
    if fmt != "bf16" and any(u.index is not None for u in units):
        notes.append("MoE experts are written under per-expert names (vLLM's and TensorRT-LLM's fused-MoE loaders "
                     "read them); transformers' from_pretrained cannot load NVFP4 experts into its fused experts "
                     "classes (it raises or leaves them undecompressed, per family: docs/moe.md), so load this "
                     "model in transformers from a --format bf16 export")
    files: dict[str, dict | None] = {"model.safetensors": None}
    hf_config = _hf_config(ckpt)
    if fmt == "nvfp4-modelopt":
        files["hf_quant_config.json"] = modelopt_config(kept, scheme)
    if hf_config is not None:
        hf_config["torch_dtype"] = "bfloat16"  # transformers' forward needs the training dtype (integrations note)
        hf_config["dtype"] = "bfloat16"
        if fmt == "nvfp4-compressed-tensors":
            hf_config["quantization_config"] = compressed_tensors_config(kept, scheme)
        else:
            hf_config.pop("quantization_config", None)
        files["config.json"] = hf_config
    elif fmt == "nvfp4-compressed-tensors":  # not an HF model: the quantization config alone, as before
        files["config.json"] = {"quantization_config": compressed_tensors_config(kept, scheme)}
    if fmt == "bf16" and hf_config is not None:
        # transformers writes its own model: its names and layout for this family (fused or per expert), by
        # construction what from_pretrained reads back
        state = {k: v.to(torch.bfloat16) for k, v in sd.items()}
        state.update(dequantized)
        _write(out, ckpt, None, files, True, hf_state=(hf_config, state))
    else:
        _write(out, ckpt, tensors, files, hf_config is not None)
    return ExportSummary(fmt, sorted(written), kept, len(tensors), sorted(files), scheme, reason, groups,
                         requantized, hf_config is not None, notes)


def _scheme(fmt: str, units, groups: list[list[str]], weight_only: bool) -> tuple[str, str]:
    """W4A4 when training recorded every unit's input amax (one per fused group: its members read one input)."""
    if fmt == "bf16":
        return "BF16", "--format bf16"
    if weight_only:
        return "W4A16", "--weight-only"
    bad = [u.key for u in units if not (isinstance(u.input_amax, (int, float)) and math.isfinite(u.input_amax)
                                        and u.input_amax > 0)]
    if bad:
        return "W4A16", (f"no finite input amax recorded for {len(bad)} weights (e.g. {bad[0]}): checkpoints from "
                         "before ds-nvfp4 recorded them, the layer never ran, or an expert got no token")
    by_key = {u.key: u for u in units}
    for g in groups:
        shared = max(by_key[n].input_amax for n in g)
        for n in g:
            by_key[n].input_amax = shared
    return "W4A4", "input amaxes recorded by training (max over ranks and steps)"


def _write(out: Path, ckpt: Path, tensors: dict | None, files: dict, hf_model: bool,
           hf_state: tuple[dict, dict] | None = None) -> None:
    """Everything to a temporary folder beside OUT, renamed into place (never half-written). ``hf_state``:
    ``(config, state dict)`` of a Hugging Face model that transformers' ``save_pretrained`` writes instead."""
    from safetensors.torch import save_file

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        if hf_state is not None:
            _save_pretrained(tmp, *hf_state)
        else:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, content in files.items():
            if content is not None and not (hf_state is not None and name == "config.json"):
                (tmp / name).write_text(json.dumps(content, indent=2))
        for name in HF_FILES if hf_model else ():
            if (ckpt / name).is_file():
                shutil.copy2(ckpt / name, tmp / name)
                files[name] = None
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_pretrained(tmp: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    """Build the model of ``config`` on the meta device, give it ``state`` (BF16, its own parameter names) and let
    transformers write it (``save_pretrained``: its file names, tensor names and per-family layout)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {k for k, v in model.state_dict().items() if v.is_meta}
    if unexpected or (set(missing) - tied - set(getattr(model, "_tied_weights_keys", None) or ())):
        model.tie_weights()
        left = [k for k, v in model.state_dict().items() if v.is_meta]
        if unexpected or left:
            raise ExportError(f"the checkpoint's weights do not fit {type(model).__name__} built from its "
                              f"config.json: missing {left[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    model.save_pretrained(tmp, safe_serialization=True)


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
