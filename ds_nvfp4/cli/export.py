"""`ds-nvfp4 export CHECKPOINT_DIR OUT_DIR --format ...`: safetensors for inference engines."""

from __future__ import annotations

import argparse

from ._common import bad_input


def register(sub: argparse._SubParsersAction) -> None:
    from ..export import FORMATS

    p = sub.add_parser("export", help="export a ds_nvfp4 DeepSpeed checkpoint to safetensors (BF16 or NVFP4)")
    p.add_argument("checkpoint_dir")
    p.add_argument("out_dir")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--tag", help="checkpoint tag (default: the 'latest' file)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..export import ExportError, export

    try:
        summary = export(args.checkpoint_dir, args.out_dir, args.format, args.tag)
    except ExportError as exc:
        return bad_input("export", exc)
    print(f"wrote {', '.join(summary['files'])} to {args.out_dir}: {len(summary['nvfp4_layers'])} layers NVFP4, "
          f"{len(summary['bf16_layers'])} BF16 ({summary['format']})")
    return 0
