"""Timing helpers shared by the benchmarks: every timed call is kept, with the machine it ran on.

Each figure of docs/benchmarks.md is the median of ``--repeats`` (>= 5 by default) timed calls after 2 warm-ups;
the JSON a benchmark writes keeps every call's seconds, the machine (CPU model and BF16 GEMM units, or the GPU),
the thread count, torch's version and the command, so `bench/tables.py` regenerates the tables from kept output.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable


def samples(fn: Callable[[], object], repeats: int, warmup: int = 2) -> list[float]:
    """Wall seconds of ``repeats`` calls after ``warmup`` calls (torch.compile compiles there)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Wall seconds of ``repeats`` rounds in which every function runs once, the order rotated each round.

    On a shared machine the speed drifts by tens of percent over a minute; timing the rows one after another puts
    that drift into their ratio. Interleaved, each round's calls see the same machine, so the ratio of a row to the
    baseline *within a round* (:func:`report` keeps them) carries far less of it."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    return statistics.median(samples(fn, repeats, warmup))


def fwd_bwd(module, x, grad, *args) -> Callable[[], None]:
    """One call of ``module(x, *args).backward(grad)`` with fresh input and parameter gradients."""

    def once() -> None:
        xi = x.detach().requires_grad_()
        module.zero_grad(set_to_none=True)
        module(xi, *args).backward(grad)

    return once


def context() -> dict:
    """Where and how a benchmark ran: the machine (ds_nvfp4.envcheck.machine), threads, torch, the command, the
    process's peak resident memory so far (``max_rss_mib``, MiB: the timed work, read before the allocator probe
    adds its own), and on a CPU the allocator (whether freed buffers come back without page faults:
    ds_nvfp4.envcheck.allocator)."""
    import resource

    import torch

    from ds_nvfp4.envcheck import allocator, machine

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    out = {"machine": machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "command": "python " + " ".join(sys.argv), "max_rss_mib": round(peak_kib / 1024, 1)}
    if out["machine"]["device"] == "cpu":  # page faults of fresh buffers are part of a CPU figure (envcheck)
        out["allocator"] = {k: v for k, v in allocator().items() if k != "advice"}
    return out


def report(rows: dict[str, list[float]], baseline: str, header: str, column: str, json_path: str | None,
           json_key: str, **extra) -> dict:
    """Print each row's median seconds and its ratio to ``rows[baseline]`` (same run); optionally write JSON with
    every sample, the medians, the ratios and :func:`context`. Returns the JSON payload.

    Rows timed by :func:`interleaved` (``extra["interleaved"]``) also keep each round's ratio to the baseline's call
    of that round (``round_ratios``); the printed range of those is the run's own measure of its noise."""
    med = {k: statistics.median(v) for k, v in rows.items()}
    rounds = {k: [a / b for a, b in zip(v, rows[baseline])] for k, v in rows.items()} \
        if extra.get("interleaved") else {}
    base = med[baseline]
    width = max(map(len, rows)) + 2
    print(header)
    print(f"{'':{width}s} {'s':>8s} {column:>{len(column) + 1}s}")
    for name, s in med.items():
        spread = f"   per round {min(rounds[name]):.2f}-{max(rounds[name]):.2f}x" if rounds else ""
        print(f"{name:{width}s} {s:8.3f} {s / base:{len(column)}.2f}x{spread}")
    payload = {"header": header, "baseline": baseline, **context(), **extra,
               "rows": {k: {"seconds": rows[k], "median": med[k], json_key: med[k] / base,
                            **({"round_ratios": rounds[k]} if rounds else {})} for k in rows}}
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(payload, fh, indent=2)
    return payload
