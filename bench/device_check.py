"""The emulated FP4 path on a GPU without FP4 tensor cores (Hopper, Ampere): correct, on tensor cores, and how fast.

Usage: python bench/device_check.py [--device cuda] [--tokens 4096] [--repeats 5] [--json out.json]
(``--device cpu --tokens 256`` is a dry run of the same code on CPU.) Prints one table:

1. the emulated GEMM on the device against the CPU float64 reference of the same operands, under the contract of
   docs/format.md (one BF16 ulp plus the FP32 summation-order bound), and which operand dtype it used: it must
   never be an FP32 CUDA-core GEMM on a GPU with BF16 tensor cores;
2. forward+backward seconds of NVFP4Linear (mission and paper recipes) against BF16 ``nn.Linear`` for LLM shapes,
   ratios within the same run;
3. the packed ZeRO-3 path on one rank: ``ds_nvfp4.initialize`` with ``ds_configs/nvfp4_zero3.json``, three steps,
   packed bytes and finite losses.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="how many of the LLM shapes to time")
    ap.add_argument("--skip-zero3", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    result = {"device": name, "torch": torch.__version__,
              "selection": ds_nvfp4.kernels.select(None, dev, smoke=False).describe(),
              "contract": contract_check(dev),
              "timings": timings(dev, args.tokens, args.repeats, SHAPES[: args.shapes])}
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
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = c["within_contract"] and c["no_fp32_cuda_core_gemm"] and result.get("zero3", {"finite": True})["finite"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
