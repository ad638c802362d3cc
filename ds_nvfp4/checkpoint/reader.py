"""Reading a DeepSpeed checkpoint back (for export): the tag, the FP32 masters, ds_nvfp4's metadata.

Every failure is a :class:`CheckpointError` whose message starts with the file at fault and says what is wrong with
it (missing, truncated or damaged), never a traceback through ``torch.load`` internals.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .metadata import FILE, CheckpointError, CheckpointMetadata, read_metadata


def checkpoint_tags(ckpt: Path) -> list[str]:
    """Tag folders of a DeepSpeed checkpoint (those holding model states)."""
    return sorted(p.name for p in ckpt.iterdir() if p.is_dir() and any(p.glob("*model_states.pt")))


def resolve_tag(ckpt: Path, tag: str | None) -> str:
    tags = checkpoint_tags(ckpt)
    listing = ", ".join(tags) or "none found"
    if tag:
        if tag not in tags:
            raise CheckpointError(f"{ckpt}: no checkpoint tag {tag!r} (tags here: {listing})")
        return tag
    latest = ckpt / "latest"
    if not latest.exists():
        raise CheckpointError(f"{ckpt}: no 'latest' file; pass --tag (tags here: {listing})")
    return latest.read_text().strip()


def _damaged(tag_dir: Path) -> str | None:
    """The first checkpoint file of ``tag_dir`` that does not load, with the reason (torch.load on the CPU)."""
    for path in sorted(tag_dir.glob("*.pt")):
        try:
            torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # what torch says of a truncated zip archive varies: name the file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"{path}: truncated or damaged ({first[:160]})"
    return None


def load_run(ckpt_dir: str | os.PathLike, tag: str | None = None
             ) -> tuple[dict[str, torch.Tensor], CheckpointMetadata]:
    """FP32 master state dict (module parameter names) and the ds_nvfp4 metadata of a checkpoint."""
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a directory (expected a DeepSpeed checkpoint folder with a 'latest' "
                              "file)")
    tag = resolve_tag(ckpt, tag)
    meta_path = ckpt / tag / FILE
    if not meta_path.exists():
        raise CheckpointError(f"{meta_path}: missing; checkpoint tag {tag!r} was not saved by an engine from "
                              "ds_nvfp4.initialize (or by deepspeed.initialize with a precision section), so which "
                              "layers are NVFP4 is unknown (for BF16 weights of a plain DeepSpeed checkpoint use "
                              "DeepSpeed's zero_to_fp32.py)")
    meta = read_metadata(meta_path)
    base = meta.precision.get("base") or {}
    if base.get("frozen"):
        where = f" ({base['checkpoint']})" if base.get("checkpoint") else ""
        raise CheckpointError(f"{meta_path}: trained adapters on a frozen base{where} (precision.base.frozen), whose "
                              "packed weights a checkpoint does not hold; save the adapters (trainer.save_model, "
                              "PeftModel.save_pretrained) and write the model with `ds-nvfp4 merge BASE ADAPTER OUT "
                              "--format bf16|nvfp4-compressed-tensors|nvfp4-modelopt`")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=tag)
    except Exception as exc:  # find the file at fault (only now: loading every file twice would be slow)
        broken = _damaged(ckpt / tag)
        raise CheckpointError(broken or f"{ckpt / tag}: DeepSpeed's zero_to_fp32 cannot read it: "
                                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                              ) from None
    return {k: v.detach().float() for k, v in sd.items()}, meta
