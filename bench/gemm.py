"""Forward+backward of one Linear: NVFP4Linear (each recipe) vs nn.Linear in BF16 and FP32, same run.

Usage: python bench/gemm.py [--features 4096] [--tokens 2048] [--repeats 3] [--json out.json]
Reports median seconds and the ratio to the BF16 nn.Linear (the baseline the mission compares against). The rows are
timed interleaved (each round runs every row once), and each round's ratio is kept: bench/_timing.py.
"""

from __future__ import annotations

import argparse

import torch
from _timing import fwd_bwd, interleaved, report
from torch import nn

import ds_nvfp4
from ds_nvfp4.nn import NVFP4Linear, Recipe


def fwd_bwd_call(layer: nn.Module, x: torch.Tensor):
    return fwd_bwd(layer, x, torch.randn(x.shape[0], layer.out_features, dtype=x.dtype))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    f, t = args.features, args.tokens
    torch.manual_seed(0)
    kernel = ds_nvfp4.kernels.select(None).name
    calls = {}
    for name, dtype in (("nn.Linear bf16", torch.bfloat16), ("nn.Linear fp32", torch.float32)):
        calls[name] = fwd_bwd_call(nn.Linear(f, f, dtype=dtype), torch.randn(t, f, dtype=dtype))
    recipes = {
        "NVFP4Linear, mission recipe (bf16 backward)": Recipe(kernel=kernel),
        "NVFP4Linear, paper recipe (FP4 backward, SR, RHT)": Recipe(backward_gemm="nvfp4", kernel=kernel),
    }
    for name, recipe in recipes.items():
        calls[name] = fwd_bwd_call(NVFP4Linear(f, f, dtype=torch.bfloat16, recipe=recipe),
                                   torch.randn(t, f, dtype=torch.bfloat16))
    report(interleaved(calls, args.repeats), "nn.Linear bf16",
                 f"[{t} x {f}] @ [{f} x {f}]^T forward+backward, bf16 activations and weights, kernel {kernel}, "
                 f"{torch.get_num_threads()} threads, median of {args.repeats}",
                 "vs bf16 nn.Linear", args.json, "ratio_to_bf16_linear", interleaved=True)

if __name__ == "__main__":
    main()
