"""Quantize / dequantize speed on this CPU, in ns per element, against a plain copy and torchao, in one run.

Usage: python bench/quantize.py [--rows 8192] [--cols 4096] [--repeats 7] [--json out.json]
(`make bench` installs torchao with --no-deps first.) Rows: each operation on a bfloat16 ``[rows, cols]`` tensor, its
ns per element (median of ``--repeats`` calls), and the fraction of copy bandwidth it reaches (the bytes it must
move over the bytes a copy of the same tensor moves, times the copy's speed over its own); the grouped quantizer
with 64 groups (MoE experts, format/grouped.py) and stochastic rounding (the FP4 backward's gradients) included.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _timing import report, samples

import ds_nvfp4
from ds_nvfp4.format import quantize_values
from ds_nvfp4.format.grouped import group_rows, quantize_grouped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also write every sample and the machine here")
    args = ap.parse_args()
    m, k = args.rows, args.cols
    x = torch.randn(m, k, dtype=torch.bfloat16)
    elems = x.numel()
    q = ds_nvfp4.quantize(x)
    groups = group_rows(torch.arange(1, 65) * (m // 64), m)
    gen = torch.Generator().manual_seed(0)
    ops = {
        "copy_ (bf16, same bytes)": (lambda: torch.empty_like(x).copy_(x), 4.0),
        "quantize 1x16 (codes)": (lambda: ds_nvfp4.quantize(x), 4.5625),
        "quantize 16x16 (codes)": (lambda: ds_nvfp4.quantize(x, block="16x16"), 4.5625),
        "quantize to GEMM operand 1x16 (values + codes)": (lambda: quantize_values(x, keep_codes=True), 6.5625),
        "quantize, 64 groups (MoE experts), values + codes": (
            lambda: quantize_grouped(x, groups, 64, keep_codes=True), 6.5625),
        "quantize 1x16, stochastic rounding (codes)": (
            lambda: ds_nvfp4.quantize(x, rounding="stochastic", generator=gen), 5.5625),
        "dequantize -> bf16": (lambda: q.dequantize(), 2.5625),
    }
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Storage, per_tensor_amax_to_scale

        ops["torchao NVFP4Storage.to_nvfp4"] = (lambda: NVFP4Storage.to_nvfp4(
            x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().max().float())), 4.5625)
    except ImportError:
        print("torchao not installed (pip install torchao --no-deps): no torchao row")
    rows = {name: samples(fn, args.repeats) for name, (fn, _) in ops.items()}
    copy_s = statistics.median(rows["copy_ (bf16, same bytes)"])
    bytes_moved = {name: moved for name, (_, moved) in ops.items()}
    header = (f"[{m} x {k}] bfloat16, {torch.get_num_threads()} threads, compiled/C++ kernels: "
              f"{ds_nvfp4.format._compile.compile_enabled(x.device)}")
    payload = report(rows, "copy_ (bf16, same bytes)", header, "time vs copy", None, "ratio_to_copy",
                     args=vars(args))
    print(f"{'operation':52s} {'ns/elem':>8s} {'of copy BW':>10s}")
    for name, v in rows.items():
        s = statistics.median(v)
        bw = bytes_moved[name] * elems / s / (4.0 * elems / copy_s)
        payload["rows"][name].update(ns_per_element=s * 1e9 / elems, bytes_per_element=bytes_moved[name],
                                     copy_bw_fraction=bw)
        print(f"{name:52s} {s * 1e9 / elems:8.2f} {bw:9.0%}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
