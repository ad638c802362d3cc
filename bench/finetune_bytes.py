"""Bytes per GPU of a LoRA fine-tune under ZeRO-3 for a 70B dense and a 671B MoE checkpoint, 8-64 GPUs: the frozen
base and the adapters' training state, for ds_nvfp4 (NVFP4 base packed from the checkpoint), BF16 LoRA and
bitsandbytes QLoRA (NF4), from the per-parameter layouts measured on CPU by bench/finetune.py.

  python bench/finetune_bytes.py --json docs/evidence/finetune/bytes_model.json   # prints the markdown table

Layouts (per base parameter, N parameters, G GPUs): NVFP4 4-bit codes + one E4M3 scale per 16 = 0.5625 B, every
byte partitioned (N x 0.5625 / G); BF16 2 B partitioned; QLoRA (``quant_storage`` BF16, double-quantized absmax, as
HF's QLoRA + ZeRO-3 recipe sets it) 0.5 B of codes partitioned plus its quantization state, which is not a
parameter and so is replicated on every GPU: one 8-bit absmax per 64 weights (+ an FP32 per 256 absmaxes): N x
(1/64 + 4/16384) B per GPU, measured on the CPU run (bench/finetune.py: 3,411,968 B per rank = 0.5 x 6,422,528 +
12,845,056 / 64). Adapters (r 16) train in BF16 with FP32 masters and two FP32 Adam moments (14 B per adapter
parameter, partitioned). Not modelled: activations, the transient gathered layer, DeepSpeed's buffers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

R = 16
GIB = 2**30


def lora_params(layers: int, projections: list[tuple[int, int]]) -> int:
    """Adapter parameters of rank R on ``projections`` ``(in, out)`` in each of ``layers`` layers."""
    return layers * sum(R * (i + o) for i, o in projections)


MODELS = {
    # Llama-3 70B: 80 layers, hidden 8192, intermediate 28672, 8 KV heads of 128; LoRA on all seven projections
    "Llama 70B (dense)": (70.6e9, lora_params(80, [(8192, 8192), (8192, 1024), (8192, 1024), (8192, 8192),
                                                   (8192, 28672), (8192, 28672), (28672, 8192)])),
    # DeepSeek-V3 671B: 61 layers; LoRA on the MLA attention projections (experts frozen, as MoE LoRA recipes do)
    "DeepSeek-V3 671B (MoE)": (671e9, lora_params(61, [(7168, 1536), (1536, 24576), (7168, 576), (512, 32768),
                                                      (16384, 7168)])),
}


def per_gpu(n: float, adapters: int, gpus: int) -> dict[str, float]:
    """GiB per GPU: base weights and the adapters' state, per method."""
    adapter_state = adapters * 14 / gpus
    base = {"ds_nvfp4 (NVFP4 base)": n * 0.5625 / gpus, "BF16 LoRA": n * 2 / gpus,
            "QLoRA NF4": n * 0.5 / gpus + n * (1 / 64 + 4 / 16384)}
    return {m: {"base_gib": b / GIB, "total_gib": (b + adapter_state) / GIB} for m, b in base.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    rows = []
    for model, (n, adapters) in MODELS.items():
        for gpus in (8, 16, 32, 64):
            rows.append({"model": model, "params": n, "adapter_params": adapters, "gpus": gpus,
                         "per_gpu": per_gpu(n, adapters, gpus)})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"command": "python bench/finetune_bytes.py --json " + args.json,
                                           "rows": rows}, indent=1))
    methods = list(rows[0]["per_gpu"])
    print("| model | GPUs | " + " | ".join(f"{m}: base / +adapters (GiB)" for m in methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for r in rows:
        cells = [f"{r['per_gpu'][m]['base_gib']:.1f} / {r['per_gpu'][m]['total_gib']:.1f}" for m in methods]
        print(f"| {r['model']} | {r['gpus']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
