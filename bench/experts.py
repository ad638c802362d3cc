"""Forward+backward of one MoE experts module: ds_nvfp4's grouped FP4 experts against transformers' own BF16 experts.

Usage: python bench/experts.py [--experts 64] [--hidden 1024] [--intermediate 512] [--tokens 4096] [--top-k 8]
                              [--repeats 5] [--json out.json]
The module is transformers' ``Qwen3MoeExperts`` built from a config. Rows, all measured in the same run:

* ``bf16 grouped_mm`` (the anchor): transformers' own ``grouped_mm`` experts implementation (torch's grouped GEMM);
* ``bf16 eager``: transformers' eager loop (one GEMM pair per expert), when ``--eager``;
* ``nvfp4 grouped``: ``FP4Experts`` (nn/experts.py), the default recipe (FP4 forward, BF16 backward).

Reports the median seconds of ``--repeats`` rounds (after 2 warm-ups; each round runs every row once, the order
rotated), every call's time, each round's ratio to the anchor, the ratio of the medians, and the machine (CPU model
and BF16 units).
"""

from __future__ import annotations

import argparse
import copy

import torch
from _timing import fwd_bwd, interleaved, report
from torch import nn

import ds_nvfp4
from ds_nvfp4.nn import Recipe
from ds_nvfp4.nn.experts import FP4Experts
from ds_nvfp4.nn.moe import find_moe


def build(experts: int, hidden: int, intermediate: int, impl: str) -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                         num_experts_per_tok=2)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    m = Qwen3MoeExperts(cfg).to(torch.bfloat16)
    for p in m.parameters():
        nn.init.normal_(p, std=0.02)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="also time transformers' eager loop (slow with 64 experts)")
    ap.add_argument("--json")
    args = ap.parse_args()
    kernel = ds_nvfp4.kernels.select(None).name
    anchor = build(args.experts, args.hidden, args.intermediate, "grouped_mm")
    holder = nn.Module()
    holder.experts, holder.gate = copy.deepcopy(anchor), nn.Linear(args.hidden, args.experts, bias=False)
    fp4 = FP4Experts.convert(holder.experts, Recipe(kernel=kernel), find_moe(holder).site_of("experts"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16)
    w, idx = torch.randn(args.tokens, args.experts, generator=g).softmax(-1).topk(args.top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    grad = torch.randn_like(x)
    calls = {"bf16 grouped_mm (transformers)": fwd_bwd(anchor, x, grad, idx, w)}
    if args.eager:
        calls["bf16 eager (transformers)"] = fwd_bwd(build(args.experts, args.hidden, args.intermediate, "eager"),
                                                     x, grad, idx, w)
    calls["nvfp4 grouped (FP4Experts)"] = fwd_bwd(fp4, x, grad, idx, w)
    report(interleaved(calls, args.repeats), "bf16 grouped_mm (transformers)",
           f"{args.experts} experts, top-{args.top_k}, H={args.hidden}, I={args.intermediate}, {args.tokens} tokens, "
           f"forward+backward; kernel {kernel}; {torch.get_num_threads()} threads; median of {args.repeats}",
           "vs grouped_mm", args.json, "ratio_to_grouped_mm", args=vars(args), kernel=kernel, interleaved=True)

if __name__ == "__main__":
    main()
