"""Timing helper shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of ``repeats`` calls after ``warmup`` calls (torch.compile compiles there)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_ratios(rows: dict[str, float], baseline: str, header: str, column: str, json_path: str | None,
                 json_key: str) -> None:
    """Print ``rows`` (name -> median seconds) with each one's ratio to ``rows[baseline]`` (same run); optionally
    write them to ``json_path`` as ``{name: {"seconds": s, json_key: ratio}}``."""
    import json

    base = rows[baseline]
    width = max(map(len, rows)) + 2
    print(header)
    print(f"{'':{width}s} {'s':>8s} {column:>{len(column) + 1}s}")
    for name, s in rows.items():
        print(f"{name:{width}s} {s:8.3f} {s / base:{len(column)}.2f}x")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({k: {"seconds": v, json_key: v / base} for k, v in rows.items()}, fh, indent=2)


def fwd_bwd_seconds(module, x, grad, repeats: int, *args) -> float:
    """Median seconds of ``module(x, *args).backward(grad)`` with fresh input and parameter gradients each call."""

    def once() -> None:
        xi = x.detach().requires_grad_()
        module.zero_grad(set_to_none=True)
        module(xi, *args).backward(grad)

    return median_seconds(once, repeats)
