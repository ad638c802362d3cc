"""Quantize / dequantize throughput on this CPU, against torchao and a plain copy, in one run.

Usage: python bench/quantize.py [--size 4096] [--repeats 5] [--json out.json]
(`make bench` installs torchao with --no-deps first.) Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import median_seconds as timeit

import ds_nvfp4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    n = args.size
    x = torch.randn(n, n, dtype=torch.bfloat16)
    elems = x.numel()
    q = ds_nvfp4.quantize(x)
    rows: dict[str, float] = {}
    rows["copy_ (bf16, same bytes)"] = timeit(lambda: torch.empty_like(x).copy_(x), args.repeats)
    rows["ds_nvfp4.quantize 1x16"] = timeit(lambda: ds_nvfp4.quantize(x), args.repeats)
    rows["ds_nvfp4.quantize 16x16"] = timeit(lambda: ds_nvfp4.quantize(x, block="16x16"), args.repeats)
    rows["ds_nvfp4.dequantize -> bf16"] = timeit(lambda: q.dequantize(), args.repeats)
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Storage, per_tensor_amax_to_scale

        def ao() -> object:
            return NVFP4Storage.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max().float()))

        rows["torchao NVFP4Storage.to_nvfp4"] = timeit(ao, args.repeats)
    except ImportError:
        print("torchao not installed (pip install torchao --no-deps): no torchao column")

    copy_s = rows["copy_ (bf16, same bytes)"]
    ao_s = rows.get("torchao NVFP4Storage.to_nvfp4")
    # bytes moved: copy reads 2 and writes 2 per element; quantize reads 2 and writes 0.5625 (+ amax pass)
    moved = {"copy_ (bf16, same bytes)": 4.0, "ds_nvfp4.dequantize -> bf16": 2.5625}
    print(f"{n}x{n} bfloat16, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"DS_NVFP4 compiled kernels: {ds_nvfp4.format._compile.compile_enabled(x.device)}")
    print(f"{'operation':34s} {'ms':>8s} {'Gelem/s':>8s} {'vs torchao':>10s} {'of copy BW':>10s}")
    out = {}
    for name, s in rows.items():
        bw = moved.get(name, 2.5625) * elems / s / (4.0 * elems / copy_s)
        ratio = ao_s / s if ao_s else float("nan")
        print(f"{name:34s} {s * 1e3:8.1f} {elems / s / 1e9:8.3f} {ratio:9.1f}x {bw:9.0%}")
        out[name] = {"ms": s * 1e3, "elements_per_s": elems / s, "speedup_vs_torchao": ratio, "copy_bw_fraction": bw}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
