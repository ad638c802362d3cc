"""`ds-nvfp4 finetune RUN_DIR --task {wordnet,sentiment}`: the downstream check, several seeds."""

from __future__ import annotations

import argparse

from ._common import bad_input


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("finetune", help="fine-tune a pretrained run on an offline classification task (several "
                                        "seeds); writes RUN_DIR/finetune.json for `compare`")
    p.add_argument("run_dir")
    p.add_argument("--task", choices=("wordnet", "sentiment"), default="wordnet")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--test-examples", type=int, default=None,
                   help="evaluate a fixed random subset of this many test examples (default: the whole split)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..evaluation.finetune import FinetuneError, finetune

    try:
        res = finetune(args.run_dir, args.task, tuple(args.seeds), args.steps, args.batch, lr=args.lr,
                       test_examples=args.test_examples)
    except FinetuneError as exc:
        return bad_input("finetune", exc)
    accs = ", ".join(f"{a:.4f}" for a in res["accuracy"])
    print(f"{args.run_dir}: {args.task} accuracy per seed {res['seeds']}: {accs} "
          f"({res['test_examples']} test examples)")
    return 0
