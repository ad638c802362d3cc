"""`ds-nvfp4 checkpoint FOLDER`: check a published NVFP4 HF folder (compressed-tensors or ModelOpt) the way a
fine-tune would load it, reading only configs, headers and global scales; exit 0 valid, 1 invalid."""

from __future__ import annotations

import argparse
import json
import sys

from ..checkpoint import CheckpointError
from ..checkpoint.hf_nvfp4 import open_nvfp4_checkpoint


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="check an NVFP4 HF checkpoint folder (compressed-tensors or ModelOpt)",
                       description="Exit 0: a valid NVFP4 folder; 1: not one (the error names the tensor and the "
                                   "file).")
    p.add_argument("folder")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        ckpt = open_nvfp4_checkpoint(args.folder)
    except CheckpointError as exc:
        print(json.dumps({"valid": False, "error": str(exc)}) if args.json else f"invalid: {exc}",
              file=sys.stdout if args.json else sys.stderr)
        return 1
    params = sum(n * k for n, k in (w.shape for w in ckpt.weights.values()))
    if args.json:
        print(json.dumps({"valid": True, "format": ckpt.format, "weights": {m: list(w.shape) for m, w in
                                                                            ckpt.weights.items()},
                          "ignore": ckpt.ignore}))
        return 0
    print(f"{args.folder}: NVFP4 ({ckpt.format}), {len(ckpt.weights)} quantized weights ({params:,} parameters, "
          f"{params * 9 // 16:,} bytes of codes and block scales), kept BF16 by the checkpoint: "
          f"{', '.join(ckpt.ignore) or 'none'}")
    return 0
