"""The emulated FP4 path on a GPU without FP4 tensor cores (Hopper, Ampere): correct, on tensor cores, and how fast.

Usage: python bench/device_check.py [--device cuda] [--tokens 4096] [--repeats 5] [--json out.json]
(``--device cpu --tokens 256`` is a dry run of the same code on CPU.) Prints one table:

1. the emulated GEMM on the device against the CPU float64 reference of the same operands, under the contract of
   docs/format.md (one BF16 ulp plus the FP32 summation-order bound), and which operand dtype it used: it must
   never be an FP32 CUDA-core GEMM on a GPU with BF16 tensor cores;
2. forward+backward seconds of NVFP4Linear (mission and paper recipes) against BF16 ``nn.Linear`` for LLM shapes,
   ratios within the same run;
3. the packed ZeRO-3 path on one rank: ``ds_nvfp4.initialize`` with ``ds_configs/nvfp4_zero3.json``, three steps,
   packed bytes and finite losses;
4. MoE experts: the grouped FP4 Linear (nn/grouped.py) equal bit for bit, forward and backward, to each expert's
   ``fp4_linear`` on the device, and ``FP4Experts`` forward+backward against transformers' own BF16 experts
   (``grouped_mm``) at E=64, top-8, hidden 1024, intermediate 512, ``--tokens`` tokens (when transformers is there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ds_nvfp4  # noqa: E402
from ds_nvfp4.kernels import get_backend, operand_choice  # noqa: E402
from ds_nvfp4.nn import NVFP4Linear, Recipe  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192)]  # (in, out): Llama-3-8B/70B-like layers


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def contract_check(dev: torch.device) -> dict:
    """The device's emulated GEMM against float64 on CPU of the same exact operands (docs/format.md bound)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for m, n, k in [(256, 128, 1024), (1000, 512, 4096)]:
        a = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
        b = torch.empty(n, k).cauchy_(generator=g)
        qa, qb = ds_nvfp4.quantize(a.to(dev)), ds_nvfp4.quantize(b.to(dev), block="16x16")
        got = get_backend("emulated").mm(qa, qb, torch.float32).cpu().double()
        va, vb = qa.block_values().cpu().double(), qb.block_values().cpu().double()
        alpha = float(qa.amax) * float(qb.amax) / 2688.0 ** 2
        ref = (va @ vb.t()) * alpha
        e = torch.frexp(ref.float().abs().clamp_min(2.0 ** -126))[1]
        bound = torch.ldexp(torch.ones_like(ref), e - 8) + k * 2.0 ** -24 * (va.abs() @ vb.abs().t()) * alpha
        rows.append({"shape": [m, n, k], "max_err_over_bound": float(((got - ref).abs() / bound).max())})
    choice = operand_choice(dev)
    ok = all(r["max_err_over_bound"] <= 1.0 for r in rows)
    tensor_cores = dev.type != "cuda" or choice.dtype != torch.float32 or torch.cuda.get_device_capability(dev) < (8, 0)
    return {"operand": choice.describe(), "within_contract": ok, "no_fp32_cuda_core_gemm": tensor_cores, "rows": rows}


def fwd_bwd(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, repeats: int) -> float:
    def once() -> None:
        xi = x.detach().requires_grad_()
        layer.zero_grad(set_to_none=True)
        layer(xi).backward(g)

    once()
    sync(x.device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        sync(x.device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def timings(dev: torch.device, tokens: int, repeats: int, shapes) -> list[dict]:
    out = []
    for k, n in shapes:
        x = torch.randn(tokens, k, dtype=torch.bfloat16, device=dev)
        g = torch.randn(tokens, n, dtype=torch.bfloat16, device=dev)
        base = fwd_bwd(nn.Linear(k, n, dtype=torch.bfloat16, device=dev), x, g, repeats)
        row = {"shape": [tokens, k, n], "bf16_s": base}
        for name, recipe in (("mission", Recipe()), ("paper", Recipe(backward_gemm="nvfp4"))):
            s = fwd_bwd(NVFP4Linear(k, n, dtype=torch.bfloat16, device=dev, recipe=recipe), x, g, repeats)
            row[f"{name}_s"], row[f"{name}_vs_bf16"] = s, s / base
        out.append(row)
        del x, g
    return out


def zero3_one_rank(dev: torch.device) -> dict:
    """ds_nvfp4.initialize with the shipped ZeRO-3 preset on a world of one: packed storage, finite losses."""
    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    cfg = json.loads((ROOT / "ds_configs" / "nvfp4_zero3.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    cfg["precision"]["modules"] = {}  # a 3-layer MLP has no transformer blocks for the preset's block rules
    cfg.pop("train_batch_size", None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 256))
    deepspeed.init_distributed(dist_backend="nccl" if dev.type == "cuda" else "gloo")
    engine, *_ = ds_nvfp4.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for _ in range(3):
        x = torch.randn(4, 256, device=engine.device, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    report = ds_nvfp4.storage_report(engine)
    return {"losses": losses, "finite": all(map(lambda v: v == v and abs(v) < float("inf"), losses)),
            "storage": report.summary() if report is not None else "not packed"}


def experts_check(dev: torch.device, tokens: int, repeats: int) -> dict:
    """Section 4 of the module docstring."""
    import copy

    from ds_nvfp4.nn.grouped import grouped_fp4_linear
    from ds_nvfp4.nn.ops import fp4_linear

    g = torch.Generator().manual_seed(0)
    sizes = [37, 0, 200, 64, 1, 130]
    x = torch.randn(sum(sizes), 256, generator=g).to(dev, torch.bfloat16).requires_grad_()
    w = (torch.randn(len(sizes), 128, 256, generator=g) * 0.05).to(dev, torch.bfloat16).requires_grad_()
    offsets = torch.tensor(sizes, device=dev).cumsum(0)
    out = {}
    for name, recipe in (("mission", Recipe()), ("paper", Recipe(backward_gemm="nvfp4", stochastic_rounding=False))):
        y = grouped_fp4_linear(x, w, None, offsets, recipe)[0]
        grad = torch.randn(y.shape, generator=g).to(dev, y.dtype)
        dx, dw = torch.autograd.grad(y, (x, w), grad)
        start, parts = 0, []
        for e, end in enumerate(offsets.tolist()):
            parts.append(fp4_linear(x[start:end], w[e], None, recipe) if end > start else y.new_zeros(0, 128))
            start = end
        ref = torch.cat(parts)
        rdx, rdw = torch.autograd.grad(ref, (x, w), grad, allow_unused=True)
        out[f"grouped_equals_per_expert_{name}"] = bool(torch.equal(y, ref) and torch.equal(dx, rdx)
                                                        and torch.equal(dw, rdw))
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError:
        return {**out, "timing": "transformers not installed"}
    from ds_nvfp4.nn.experts import FP4Experts
    from ds_nvfp4.nn.moe import find_moe

    cfg = Qwen3MoeConfig(hidden_size=1024, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    anchor = Qwen3MoeExperts(cfg).to(dev, torch.bfloat16)
    for prm in anchor.parameters():  # a bare experts module is not initialised by its model's _init_weights
        nn.init.normal_(prm, std=0.02)
    holder = nn.Module()
    holder.experts, holder.gate = copy.deepcopy(anchor), nn.Linear(1024, 64, bias=False)
    fp4 = FP4Experts.convert(holder.experts, Recipe(), find_moe(holder).site_of("experts"))
    hidden = torch.randn(tokens, 1024, device=dev, dtype=torch.bfloat16)
    top_w, idx = torch.randn(tokens, 64, device=dev).softmax(-1).topk(8, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(torch.bfloat16)
    grad = torch.randn_like(hidden)

    def run(m) -> float:
        def once() -> None:
            xi = hidden.detach().requires_grad_()
            m.zero_grad(set_to_none=True)
            m(xi, idx, top_w).backward(grad)

        once()
        sync(dev)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            sync(dev)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    base, mine = run(anchor), run(fp4)
    with torch.no_grad():
        rel = float((fp4(hidden, idx, top_w) - anchor(hidden, idx, top_w)).float().norm()
                    / anchor(hidden, idx, top_w).float().norm())
    return {**out, "bf16_grouped_mm_s": base, "fp4_experts_s": mine, "ratio": mine / base,
            "relative_error_vs_bf16": rel, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="how many of the LLM shapes to time")
    ap.add_argument("--skip-zero3", action="store_true")
    ap.add_argument("--skip-experts", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    result = {"device": name, "torch": torch.__version__,
              "selection": ds_nvfp4.kernels.select(None, dev, smoke=False).describe(),
              "contract": contract_check(dev),
              "timings": timings(dev, args.tokens, args.repeats, SHAPES[: args.shapes])}
    if not args.skip_experts:
        result["experts"] = experts_check(dev, args.tokens, args.repeats)
    if not args.skip_zero3:
        result["zero3"] = zero3_one_rank(dev)
    c = result["contract"]
    print(f"{name}, torch {torch.__version__}; {result['selection']}")
    print(f"emulated GEMM within the contract: {c['within_contract']} (max err/bound "
          f"{max(r['max_err_over_bound'] for r in c['rows']):.3f}); no FP32 CUDA-core GEMM: "
          f"{c['no_fp32_cuda_core_gemm']}")
    print(f"{'tokens x in x out':>22s} {'bf16 s':>9s} {'mission s':>10s} {'vs bf16':>8s} {'paper s':>9s} "
          f"{'vs bf16':>8s}")
    for r in result["timings"]:
        print(f"{'x'.join(map(str, r['shape'])):>22s} {r['bf16_s']:9.4f} {r['mission_s']:10.4f} "
              f"{r['mission_vs_bf16']:7.2f}x {r['paper_s']:9.4f} {r['paper_vs_bf16']:7.2f}x")
    if "zero3" in result:
        z = result["zero3"]
        print(f"ZeRO-3 packed, 1 rank: losses {[round(v, 4) for v in z['losses']]} finite {z['finite']}; "
              f"{z['storage']}")
    if "experts" in result:
        x = result["experts"]
        print(f"MoE experts: grouped == per-expert bit for bit: mission {x['grouped_equals_per_expert_mission']}, "
              f"paper {x['grouped_equals_per_expert_paper']}"
              + (f"; FP4Experts {x['fp4_experts_s']:.4f} s vs transformers grouped_mm BF16 "
                 f"{x['bf16_grouped_mm_s']:.4f} s = {x['ratio']:.2f}x (E=64, top-8, 1024/512, {x['tokens']} tokens, "
                 f"fwd+bwd), relative output error vs BF16 {x['relative_error_vs_bf16']:.3f}" if "ratio" in x
                 else f"; {x.get('timing')}"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = c["within_contract"] and c["no_fp32_cuda_core_gemm"] and result.get("zero3", {"finite": True})["finite"]
    ok = ok and all(v for k, v in result.get("experts", {}).items() if k.startswith("grouped_equals"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
