"""A model of ZeRO-3 step time on GPU clusters: compute + exposed communication, per collective, with overlap.

    python bench/cluster_model.py --out docs/scaling_model.png --json docs/evidence/scaling/model.json

Per GPU and optimizer step, for a dense model of ``P`` parameters and ``T`` tokens per GPU:

- compute: ``6 P T`` FLOPs at ``MFU`` of the GPU's dense peak; with NVFP4 the forward GEMMs of the packed share
  ``f`` of the weights (the default recipe: FP4 Fprop, BF16 Dgrad/Wgrad) run at the FP4 peak (B200), or at the BF16
  peak with a dequantize-and-quantize pass on a GPU without FP4 tensor cores (H100: the emulated path, no faster);
- communication: the forward gather, the backward gather and the gradient reduce-scatter of ZeRO-3, each of
  ``bytes x (N-1)/N`` on every GPU's link (ring algorithms, NCCL's choice for these collectives) plus
  ``(N-1) x latency`` per collective and ``3 L`` collectives per step (one per layer and phase); the link is NVLink
  within a node of 8 and InfiniBand (the per-GPU NIC) once the ranks span nodes;
- overlap: a phase's communication hides behind that phase's compute up to ``overlap x compute`` (the forward
  gather behind the forward; the backward gather and the reduce-scatter behind the backward); ``overlap`` 0 is
  ZeRO-3 as these presets configure it on CPU (overlap_comm false: calibrated in docs/scaling.md, slope ~1), 0.9
  DeepSpeed's prefetching with overlap_comm true on GPUs.

Bytes: ds_nvfp4.zero.traffic (BF16 gathers 2 B/param, NVFP4 gathers 0.504 B/param for the packed share, BF16
reduce-scatter 2 B/param). Every number is a stated assumption (data-sheet peaks, MFU 40%, latencies), not a
measurement on those machines.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_nvfp4.zero.traffic import step_traffic


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float        # dense tensor-core peak, FLOP/s (data sheet)
    fp4_flops: float | None  # dense NVFP4 peak, FLOP/s; None: no FP4 tensor cores (emulated at the BF16 rate)
    nvlink_bytes: float      # per GPU and direction, bytes/s
    ib_bytes: float          # per GPU NIC and direction, bytes/s
    nvlink_latency: float = 3e-6
    ib_latency: float = 8e-6


#: data-sheet figures: B200 (HGX B200: 2.25 PFLOP/s BF16 dense, 9 PFLOP/s FP4 dense, NVLink 5 1.8 TB/s
#: bidirectional, ConnectX-7 400 Gb/s per GPU); H100 SXM (989 TFLOP/s BF16 dense, NVLink 4 900 GB/s bidirectional,
#: NDR 400 Gb/s per GPU)
GPUS = {"B200": GPU("B200", 2.25e15, 9e15, 900e9, 50e9), "H100": GPU("H100", 0.989e15, None, 450e9, 50e9)}
#: name: (parameters, layers); Llama-like shapes
MODELS = {"1B": (1.2e9, 16), "7B": (6.7e9, 32), "13B": (13e9, 40), "70B": (70e9, 80)}
CONFIGS = ("bf16", "zeropp_hpz", "zeropp_qwz", "zeropp", "nvfp4_bf16_gather", "nvfp4_nvfp4_gather")
#: the DeepSpeed baselines a user who cares about gather traffic picks from (ZeRO++, Wang et al. 2023)
DEEPSPEED = ("bf16", "zeropp_hpz", "zeropp_qwz", "zeropp")
GPUS_PER_NODE = 8
#: ZeRO++ bytes per parameter: qwZ gathers INT8 weights with one FP32 scale per ~8,000 elements (DeepSpeed's
#: CUDAQuantizer.target_group_size); qgZ reduce-scatters INT4 gradients (plus scales) by all-to-all
QWZ_BYTES, QGZ_BYTES = 1.0 + 4 / 8000, 0.5 + 4 / 2048


def step_time(gpu: GPU, params: float, layers: int, n: int, config: str, tokens: int = 8192, mfu: float = 0.4,
              packed_share: float = 0.8, overlap: float = 0.9) -> dict:
    """Seconds per optimizer step on each of ``n`` GPUs, split into compute and exposed communication."""
    flops = 6 * params * tokens
    bf16 = mfu * gpu.bf16_flops
    nvfp4 = config.startswith("nvfp4")
    if not nvfp4:  # BF16 ZeRO-3 and the ZeRO++ configurations: BF16 GEMMs
        fwd, bwd = flops / 3 / bf16, 2 * flops / 3 / bf16
    else:
        fp4 = mfu * gpu.fp4_flops if gpu.fp4_flops else bf16  # no FP4 cores: the forward is a BF16 GEMM again
        fwd = packed_share * flops / 3 / fp4 + (1 - packed_share) * flops / 3 / bf16
        bwd = 2 * flops / 3 / bf16
    packed = int(packed_share * params) if nvfp4 else 0
    t = step_traffic(int(params), packed, all_gather="nvfp4" if config == "nvfp4_nvfp4_gather" else "bf16")
    fwd_bytes = bwd_bytes = t.gather_bytes_per_pass
    rs_bytes = t.reduce_scatter_bytes
    if config in ("zeropp_qwz", "zeropp"):  # qwZ: INT8 gathers
        fwd_bytes = bwd_bytes = params * QWZ_BYTES
    if config == "zeropp":  # qgZ: INT4 gradients
        rs_bytes = params * QGZ_BYTES
    inter = n > GPUS_PER_NODE
    link, lat = (gpu.ib_bytes, gpu.ib_latency) if inter else (gpu.nvlink_bytes, gpu.nvlink_latency)
    share = (n - 1) / n
    per_collective = (n - 1) * lat * layers
    fwd_gather = fwd_bytes * share / link + per_collective
    if config in ("zeropp_hpz", "zeropp") and inter:
        # hpZ: the backward gathers the node's secondary partition (BF16) over NVLink, never across nodes
        k = GPUS_PER_NODE
        bwd_gather = 2 * params * (k - 1) / k / gpu.nvlink_bytes + (k - 1) * gpu.nvlink_latency * layers
    else:
        bwd_gather = bwd_bytes * share / link + per_collective
    rs = rs_bytes * share / link + per_collective
    exposed_fwd = max(0.0, fwd_gather - overlap * fwd)
    exposed_bwd = max(0.0, bwd_gather + rs - overlap * bwd)
    comm = fwd_gather + bwd_gather + rs
    return {"compute_s": fwd + bwd, "exposed_s": exposed_fwd + exposed_bwd, "step_s": fwd + bwd + exposed_fwd
            + exposed_bwd, "comm_s": comm, "reduce_scatter_share_of_comm": rs / comm}


def predictions(overlap: float, tokens: int) -> dict:
    ns = [8, 16, 32, 64, 128, 256, 512, 1024]
    out = {}
    for g in GPUS.values():
        for m, (p, layers) in MODELS.items():
            out[f"{g.name} {m}"] = {c: [step_time(g, p, layers, n, c, tokens=tokens, overlap=overlap) | {"gpus": n}
                                        for n in ns] for c in CONFIGS}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step")
    ap.add_argument("--out", default="docs/scaling_model.png")
    ap.add_argument("--json")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = {str(ov): predictions(ov, args.tokens) for ov in (0.0, 0.9)}
    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5), sharex=True)
    style = {"bf16": ("tab:gray", "BF16 ZeRO-3"), "zeropp_hpz": ("tab:olive", "BF16 ZeRO++ hpZ"),
             "zeropp_qwz": ("tab:green", "BF16 ZeRO++ qwZ"), "zeropp": ("tab:purple", "BF16 ZeRO++ (qwZ+hpZ+qgZ)"),
             "nvfp4_bf16_gather": ("tab:blue", "NVFP4, BF16 gathers"),
             "nvfp4_nvfp4_gather": ("tab:red", "NVFP4, NVFP4 gathers")}
    for row, gpu in enumerate(GPUS):
        for col, m in enumerate(MODELS):
            ax = axes[row, col]
            for ov, ls in (("0.9", "-"), ("0.0", ":")):
                for c, rows in res[ov][f"{gpu} {m}"].items():
                    color, label = style[c]
                    ax.plot([r["gpus"] for r in rows], [args.tokens / r["step_s"] for r in rows], ls, color=color,
                            label=f"{label} (overlap {ov})" if row == col == 0 else None)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{gpu}, {m} params, {args.tokens} tokens/GPU/step", fontsize=9)
            ax.axvline(GPUS_PER_NODE, color="k", lw=0.5, alpha=0.4)
            if col == 0:
                ax.set_ylabel("tokens/s per GPU (model)")
            if row == 1:
                ax.set_xlabel("GPUs (NVLink within 8, InfiniBand beyond)")
    fig.legend(loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("ZeRO-3 throughput per GPU, modelled (bench/cluster_model.py): solid 90% overlap, dotted none")
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    # the table docs/scaling.md cites: each size at 8 to 1,024 GPUs, NVFP4 gathers against plain ZeRO-3 and against
    # the fastest DeepSpeed configuration (ZeRO-3 or a ZeRO++ combination) at that point
    print("| GPU | model | overlap | GPUs | BF16 ZeRO-3 tok/s/GPU | best DeepSpeed (which) | NVFP4 NVFP4-gather | "
          "vs ZeRO-3 | vs best DeepSpeed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gpu in GPUS:
        for m in MODELS:
            for ov in ("0.9", "0.0"):
                for i in range(len(res[ov][f"{gpu} {m}"]["bf16"])):
                    r = {c: res[ov][f"{gpu} {m}"][c][i] for c in CONFIGS}
                    tps = {c: args.tokens / r[c]["step_s"] for c in CONFIGS}
                    best = max(DEEPSPEED, key=lambda c: tps[c])
                    print(f"| {gpu} | {m} | {ov} | {r['bf16']['gpus']} | {tps['bf16']:,.0f} | "
                          f"{tps[best]:,.0f} ({best}) | {tps['nvfp4_nvfp4_gather']:,.0f} | "
                          f"{tps['nvfp4_nvfp4_gather'] / tps['bf16']:.2f}x | "
                          f"{tps['nvfp4_nvfp4_gather'] / tps[best]:.2f}x |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "predictions": res}, indent=1))


if __name__ == "__main__":
    main()
