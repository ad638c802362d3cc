"""`ds-nvfp4 probe RUN_DIR`: the deterministic downstream check (linear probe on frozen features)."""

from __future__ import annotations

import argparse

from ._common import bad_input


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="linear probe of a pretrained run's frozen features on WordNet supersenses "
                                     "(deterministic, no seeds); writes RUN_DIR/probe.json for `compare`")
    p.add_argument("run_dir")
    p.add_argument("--task", choices=("wordnet",), default="wordnet")
    p.add_argument("--examples", type=int, default=None,
                   help="labelled examples, cross-fitted (default: all 117,659; the 95%% interval of a gap shrinks as "
                        "1/sqrt of this: +-0.21 points with all of them at 5M, +-0.37 with 40,000)")
    p.add_argument("--folds", type=int, default=5)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..evaluation.finetune import FinetuneError
    from ..evaluation.linear_probe import probe

    try:
        res = probe(args.run_dir, args.task, args.examples, args.folds)
    except FinetuneError as exc:
        return bad_input("probe", exc)
    print(f"{args.run_dir}: {args.task} linear-probe accuracy {res['accuracy']:.4f} over {res['examples']} examples "
          f"({res['folds']}-fold cross-fitted; {res['seconds']['total']:.0f} s)")
    return 0
