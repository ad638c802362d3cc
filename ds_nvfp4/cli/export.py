"""`ds-nvfp4 export CHECKPOINT_DIR OUT_DIR --format ...`: a model folder for transformers / vLLM / TensorRT-LLM."""

from __future__ import annotations

import argparse

from ._common import bad_input, model_folder_parser


def register(sub: argparse._SubParsersAction) -> None:
    from ..export import FORMATS

    p = model_folder_parser(
        sub, "export", "export a ds_nvfp4 DeepSpeed checkpoint (also an HF Trainer checkpoint-N folder) to "
                       "safetensors: BF16, ModelOpt NVFP4 or compressed-tensors NVFP4",
        [("checkpoint_dir", "folder with a 'latest' file and tag folders (HF: checkpoint-N)")], FORMATS)
    p.add_argument("--tag", help="checkpoint tag (default: the 'latest' file)")
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
