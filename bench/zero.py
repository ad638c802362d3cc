"""ZeRO-3 on 2 CPU ranks: NVFP4 packed storage vs the BF16 baseline, measured in one invocation.

Usage: python bench/zero.py [--d 256] [--layers 4] [--steps 12] [--json out.json]
Runs four 2-rank jobs (BF16 ZeRO-3; NVFP4 with bf16 all-gather; NVFP4 with nvfp4 all-gather; NVFP4 with the
optimizer offloaded) and prints per-rank weight bytes, model-state bytes, step time ratios, the store's own
overhead per step and all-gather bytes per step. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch
    from torch import nn

    import ds_nvfp4
    from ds_nvfp4.config import with_overrides

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, d: int, layers: int, vocab: int = 256) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
            self.ln = nn.LayerNorm(d)

        def forward(self, idx):
            h = self.embed(idx)
            for blk in self.blocks:
                h = blk(h)
            logits = self.ln(h) @ self.embed.weight.t()
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256).float(), idx[:, 1:].reshape(-1))

    cfg = json.loads((ROOT / "ds_configs" / args.preset).read_text())
    with_overrides(cfg, json.loads(args.override))
    torch.manual_seed(0)
    model = GPT(args.d, args.layers)
    engine, opt, *_ = ds_nvfp4.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(rank)
    times = []
    store = getattr(getattr(engine, "ds_nvfp4", None), "store", None)
    for step in range(args.steps):
        idx = torch.randint(0, 256, (cfg["train_micro_batch_size_per_gpu"], 64), generator=g)
        if step == 2 and store is not None:  # warm-up over: count from here
            store.gathered_bytes = 0
            store.seconds = dict.fromkeys(store.seconds, 0.0)
        t0 = time.perf_counter()
        loss = engine(idx)
        engine.backward(loss)
        engine.step()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    measured = args.steps - 2
    converted = {id(m.weight) for m in engine.module.modules() if isinstance(m, ds_nvfp4.NVFP4Linear)}
    lin = [p for m in engine.module.modules() if isinstance(m, nn.Linear) for p in [m.weight]]
    bf16_linear_bytes = sum(p.ds_tensor.ds_numel * 2 for p in lin)
    rep = ds_nvfp4.storage_report(engine)
    if rep is not None:
        weight_bytes = rep.packed_bytes + sum(p.ds_tensor.ds_numel * 2 for p in lin if id(p) not in converted)
    else:
        weight_bytes = bf16_linear_bytes
    all_params = list(engine.module.parameters())
    lp_bytes = (rep.packed_bytes + rep.bf16_bytes) if rep else sum(p.ds_tensor.ds_numel * 2 for p in all_params)
    grad_bytes = sum(p.ds_tensor.ds_numel * 2 for p in all_params)
    fp32 = sum(t.numel() * 4 for t in opt.fp32_partitioned_groups_flat)
    offload = bool(cfg["zero_optimization"].get("offload_optimizer"))
    device_state = lp_bytes + grad_bytes + (0 if offload else fp32 * 3)  # master + 2 Adam moments
    out = {"rank": rank, "step_s": statistics.median(times), "step_s_samples": times,
           "linear_weight_bytes": weight_bytes,
           "bf16_linear_weight_bytes": bf16_linear_bytes, "device_model_state_bytes": device_state,
           "offload": offload,
           "gathered_bytes_per_step": (store.gathered_bytes / measured) if store else None,
           "store_seconds_per_step": ({k: v / measured for k, v in store.seconds.items()} if store else None)}
    Path(args.out).write_text(json.dumps(out))
    torch.distributed.barrier()


def run_job(preset: str, override: dict, args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                       PYTHONPATH=str(ROOT))
            cmd = [sys.executable, __file__, "--worker", "--preset", preset, "--override", json.dumps(override),
                   "--out", f"{tmp}/r{rank}.json", "--d", str(args.d), "--layers", str(args.layers),
                   "--steps", str(args.steps)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=900)
            if p.returncode:
                raise SystemExit(f"{preset} {override} failed:\n{err[-3000:]}")
        return [json.loads(Path(f"{tmp}/r{r}.json").read_text()) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="bf16_zero3.json", help=argparse.SUPPRESS)
    ap.add_argument("--override", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    offload = {"zero_optimization.offload_optimizer": {"device": "cpu"}, "zero_force_ds_cpu_optimizer": False}
    every_block = "nvfp4_zero3_all_blocks_ablation.json"  # storage at its widest: every block's weights packed
    jobs = {
        "BF16 ZeRO-3": ("bf16_zero3.json", {}),
        "NVFP4, bf16 all-gather": (every_block, {"precision.communication.all_gather": "bf16"}),
        "NVFP4, nvfp4 all-gather": (every_block, {"precision.communication.all_gather": "nvfp4"}),
        "BF16 ZeRO-3 + offload_optimizer": ("bf16_zero3.json", offload),
        "NVFP4 + offload_optimizer": (every_block, {**offload, "precision.communication.all_gather": "bf16"}),
    }
    res = {name: run_job(p, o, args)[0] for name, (p, o) in jobs.items()}
    base = res["BF16 ZeRO-3"]
    print(f"2 ranks x 1 thread, d={args.d}, {args.layers} blocks, seq 64, micro-batch 4, median of "
          f"{args.steps - 2} steps (rank 0)")
    print(f"{'run':34s} {'step s':>7s} {'vs BF16':>8s} {'Linear W bytes':>15s} {'ratio':>7s} "
          f"{'model-state/dev':>16s} {'gather B/step':>14s} {'store s/step':>13s}")
    for name, r in res.items():
        gb = f"{r['gathered_bytes_per_step']:,.0f}" if r["gathered_bytes_per_step"] is not None else "-"
        st = f"{sum(r['store_seconds_per_step'].values()):.4f}" if r["store_seconds_per_step"] else "-"
        print(f"{name:34s} {r['step_s']:7.3f} {r['step_s'] / base['step_s']:7.2f}x {r['linear_weight_bytes']:15,} "
              f"{r['linear_weight_bytes'] / base['linear_weight_bytes']:6.4f}x {r['device_model_state_bytes']:16,} "
              f"{gb:>14s} {st:>13s}")
    if args.json:
        sys.path.insert(0, str(ROOT / "bench"))
        from _timing import context

        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k in
                                                        ("d", "layers", "steps")}, **context(), "rows": res},
                                              indent=2))


if __name__ == "__main__":
    main()
