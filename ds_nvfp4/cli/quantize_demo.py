"""`ds-nvfp4 quantize-demo`: quantize a tensor and show what NVFP4 keeps of it."""

from __future__ import annotations

import argparse

import torch


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize-demo", help="quantize a random or heavy-tailed matrix and report the error")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--dist", choices=("randn", "cauchy"), default="randn")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import ds_nvfp4

    x = torch.randn(args.rows, args.cols) if args.dist == "randn" else torch.empty(args.rows, args.cols).cauchy_()
    print(f"{args.dist} [{args.rows}, {args.cols}] float32: {x.numel() * 4:,} bytes, amax {x.abs().max():.4g}")
    for block in ("1x16", "16x16"):
        q = ds_nvfp4.quantize(x, block=block)
        err = (q.dequantize(torch.float32) - x).norm() / x.norm()
        zero = (q.dequantize(torch.float32) == 0).float().mean()
        print(f"  {block:5s}: {q.nbytes:,} bytes ({q.nbytes / (x.numel() * 2):.4f} of bf16), "
              f"relative L2 error {err:.4f}, flushed to zero {zero:.2%}")
    return 0
