"""`ds-nvfp4 merge BASE ADAPTER OUT --format ...`: LoRA adapters trained on a frozen NVFP4 checkpoint merged into one
model folder (BF16, or NVFP4 again for serving); export/merge.py does the work."""

from __future__ import annotations

import argparse

from ._common import bad_input, model_folder_parser


def register(sub: argparse._SubParsersAction) -> None:
    from ..export.merge import MERGE_FORMATS

    p = model_folder_parser(
        sub, "merge", "merge LoRA adapters (PEFT format) into their NVFP4 base checkpoint: a BF16 or NVFP4 model "
                      "folder",
        [("base", "the NVFP4 HF folder the adapters were trained on (precision.base.checkpoint)"),
         ("adapter", "the adapter folder (adapter_config.json, adapter_model.safetensors)")], MERGE_FORMATS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError
    from ..export.merge import merge
    from ..export.writer import ExportError

    try:
        s = merge(args.base, args.adapter, args.out_dir, args.format, force=args.force)
    except (ExportError, CheckpointError) as exc:
        return bad_input("merge", exc)
    print(f"merged {s.adapters} LoRA-adapted layers into {args.base}: wrote {args.out_dir} ({s.format}; "
          f"{len(s.nvfp4_layers)} layers NVFP4, BF16: {', '.join(s.bf16_layers[:3]) or 'none'}"
          f"{', ...' if len(s.bf16_layers) > 3 else ''})")
    return 0
