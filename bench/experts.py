"""Forward+backward of one MoE experts module: FP4Experts (NVFP4 GEMMs per expert) vs the same module in BF16.

Usage: python bench/experts.py [--experts 8] [--hidden 1024] [--intermediate 512] [--tokens 2048] [--top-k 2]
                              [--repeats 3] [--json out.json]
The module is transformers' ``Qwen3MoeExperts`` (eager loop) built from a config; the BF16 baseline is that class's
own forward, measured in the same run. Reports median seconds and the ratio to the BF16 experts.
"""

from __future__ import annotations

import argparse
import copy

import torch
from _timing import fwd_bwd_seconds, print_ratios
from torch import nn

import ds_nvfp4
from ds_nvfp4.nn import Recipe
from ds_nvfp4.nn.experts import FP4Experts


def build(experts: int, hidden: int, intermediate: int) -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                         num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    m = Qwen3MoeExperts(cfg).to(torch.bfloat16)
    for p in m.parameters():
        nn.init.normal_(p, std=0.02)
    return m


def fwd_bwd_time(m: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    return fwd_bwd_seconds(m, x, torch.randn_like(x), repeats, idx, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    kernel = ds_nvfp4.kernels.select(None).name
    bf16 = build(args.experts, args.hidden, args.intermediate)
    fp4 = FP4Experts.convert(copy.deepcopy(bf16), Recipe(kernel=kernel))
    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(args.experts)[: args.top_k] for _ in range(args.tokens)])
    w = torch.softmax(torch.randn(args.tokens, args.top_k), -1).to(torch.bfloat16)
    rows = {"experts bf16 (transformers eager)": fwd_bwd_time(bf16, x, idx, w, args.repeats),
            "FP4Experts, mission recipe (bf16 backward)": fwd_bwd_time(fp4, x, idx, w, args.repeats)}
    print_ratios(rows, "experts bf16 (transformers eager)",
                 f"{args.experts} experts, H={args.hidden}, I={args.intermediate}, {args.tokens} tokens "
                 f"top-{args.top_k}, kernel {kernel}, {torch.get_num_threads()} threads, median of {args.repeats}",
                 "vs bf16 experts", args.json, "ratio_to_bf16_experts")

if __name__ == "__main__":
    main()
