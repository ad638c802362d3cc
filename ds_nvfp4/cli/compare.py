"""`ds-nvfp4 compare BASELINE_RUN NVFP4_RUN`: the acceptance report of one pair of runs;
`ds-nvfp4 compare --baselines B... --candidates C...`: seed sets paired by seed, judged by the mean paired gap's 95%
t interval (evaluation/seedset.py).

Exit 0 pass, 1 fail, 3 inconclusive, 2 bad input.
"""

from __future__ import annotations

import argparse

from ._common import bad_input


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="BF16-vs-NVFP4 acceptance report of two launch/train.py runs",
                       description="Exit 0: pass; 1: fail; 3: inconclusive (confidence interval wider than the "
                                   "threshold); 2: runs that cannot be compared.")
    p.add_argument("baseline", nargs="?")
    p.add_argument("candidate", nargs="?")
    p.add_argument("--baselines", nargs="+", metavar="RUN",
                   help="seed set: the BF16 runs (one per --seed), judged with --candidates paired by seed")
    p.add_argument("--candidates", nargs="+", metavar="RUN", help="seed set: the NVFP4 runs, one per seed")
    p.add_argument("--out", help="report directory (default: the candidate run directory)")
    p.add_argument("--loss-gap", type=float, default=0.01, help="max final relative validation-loss gap (0.01 = 1%%)")
    p.add_argument("--acc-gap", type=float, default=0.5, help="max downstream accuracy gap, points")
    p.add_argument("--seeds-may-differ", action="store_true",
                   help="compare runs trained with different --seed (two runs of one recipe: the noise floor)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..evaluation.acceptance import CompareError, compare, write

    if args.baselines or args.candidates:
        if args.baseline or args.candidate or not (args.baselines and args.candidates):
            return bad_input("compare", ValueError("give either BASELINE CANDIDATE (one pair) or --baselines RUN... "
                                                   "--candidates RUN... (seed sets), not both"))
        return _seed_sets(args)
    if not (args.baseline and args.candidate):
        return bad_input("compare", ValueError("give BASELINE CANDIDATE (one pair) or --baselines RUN... "
                                               "--candidates RUN... (seed sets)"))
    try:
        rep = compare(args.baseline, args.candidate, args.loss_gap, args.acc_gap, args.seeds_may_differ)
    except CompareError as exc:
        return bad_input("compare", exc)
    paths = write(rep, args.out or args.candidate)
    for c in rep.criteria:
        gap = "-" if c.value is None else (f"{c.value:+.3%}" if c.unit == "relative" else f"{c.value:+.2f} {c.unit}")
        ci = "" if c.ci is None else (f" CI [{c.ci[0]:+.3%}, {c.ci[1]:+.3%}]" if c.unit == "relative"
                                      else f" CI [{c.ci[0]:+.2f}, {c.ci[1]:+.2f}]")
        print(f"{c.name}: {gap}{ci} -> {c.verdict}" + ("" if c.counts else " (supporting evidence)"))
    r = rep.ratios
    print(f"candidate vs baseline ({rep.machines}; speed is comparable only when the two runs did not overlap with "
          f"other work): tokens/s {r['tokens_per_s']:.2f}x, weight bytes per rank {r['weight_bytes_per_rank']:.3f}x, "
          f"peak RSS per rank {r['peak_rss_per_rank']:.2f}x")
    print(f"verdict: {rep.verdict}; report: {paths['md']}, plot: {paths['png']}")
    return rep.exit_code


def _seed_sets(args: argparse.Namespace) -> int:
    from ..evaluation.acceptance import CompareError
    from ..evaluation.seedset import compare_seed_sets, write_seed_set

    if args.seeds_may_differ:
        return bad_input("compare", ValueError("--seeds-may-differ is for one pair; seed sets are paired by seed"))
    try:
        rep = compare_seed_sets(args.baselines, args.candidates, args.loss_gap)
    except CompareError as exc:
        return bad_input("compare", exc)
    paths = write_seed_set(rep, args.out or args.candidates[0] + "_seedset")
    for p in rep.pairs:
        print(f"seed {p.seed}: {p.gap:+.3%} CI [{p.ci[0]:+.3%}, {p.ci[1]:+.3%}] ({p.source}) -> {p.verdict} alone")
    print(f"mean paired gap over {len(rep.pairs)} seeds: {rep.mean:+.3%}, 95% t interval [{rep.ci[0]:+.3%}, "
          f"{rep.ci[1]:+.3%}], sd {rep.sd:.3%}; BF16 seed spread {rep.bf16_spread:.3%}"
          + (f"; ~{rep.seeds_needed} seeds would decide it" if rep.seeds_needed else ""))
    print(f"verdict: {rep.verdict}; report: {paths['md']}, plot: {paths['png']}")
    return rep.exit_code
