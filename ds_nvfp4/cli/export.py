"""`ds-nvfp4 export CHECKPOINT_DIR OUT_DIR --format ...`: a model folder for transformers / vLLM / TensorRT-LLM."""

from __future__ import annotations

import argparse

from ._common import bad_input


def register(sub: argparse._SubParsersAction) -> None:
    from ..export import FORMATS

    p = sub.add_parser("export", help="export a ds_nvfp4 DeepSpeed checkpoint (also an HF Trainer checkpoint-N "
                                      "folder) to safetensors: BF16, ModelOpt NVFP4 or compressed-tensors NVFP4",
                       description="Exit 0: written; 2: bad input (nothing written).")
    p.add_argument("checkpoint_dir", help="folder with a 'latest' file and tag folders (HF: checkpoint-N)")
    p.add_argument("out_dir", help="new or empty folder (see --force)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--tag", help="checkpoint tag (default: the 'latest' file)")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty OUT_DIR whole")
    p.add_argument("--weight-only", action="store_true",
                   help="declare W4A16 even when training recorded input amaxes (default: W4A4 when it did)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..export import ExportError, export

    try:
        s = export(args.checkpoint_dir, args.out_dir, args.format, args.tag, force=args.force,
                   weight_only=args.weight_only)
    except ExportError as exc:
        return bad_input("export", exc)
    print(f"wrote {', '.join(s.files)} to {args.out_dir}: {len(s.nvfp4_layers)} layers NVFP4, "
          f"{len(s.bf16_layers)} BF16 ({s.format}, {s.scheme}: {s.scheme_reason})")
    if s.fused_groups:
        print(f"{len(s.fused_groups)} fused groups with one global scale each (vLLM qkv_proj/gate_up_proj)")
    for g in s.requantized:
        print(f"warning: fused group {g} was trained with separate amaxes: re-quantized with one global scale "
              "(its codes differ from training's)")
    for note in s.notes:
        print(f"note: {note}")
    if not s.hf_model:
        print("note: no HF config.json in the checkpoint folder: transformers and vLLM need one with "
              "'architectures' and 'model_type' (HF Trainer checkpoints have it)")
    return 0
