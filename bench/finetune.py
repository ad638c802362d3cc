"""LoRA on an NVFP4 checkpoint under ZeRO-3 (ds_nvfp4 ``precision.base``) against BF16 LoRA and bitsandbytes QLoRA
(NF4), on 2 CPU ranks, in one run: per-rank bytes of the base weights and of the model state, tokens/s as a ratio
to BF16 LoRA measured in the same run, and the loss after N steps (docs/finetune.md).

  python bench/finetune.py --json docs/evidence/finetune/lora_compare.json --repeat 3   # ~15 min on 2 cores
  python bench/finetune.py --table docs/evidence/finetune/lora_compare.json            # its markdown table

The base: a Llama (hidden 512, 4 layers, intermediate 1408, vocab 256, 14.7M parameters in its projections) with
random weights, written as a compressed-tensors NVFP4 folder (as ``ds-nvfp4 export`` writes one); the BF16 and
QLoRA runs start from the same values dequantized. Needs ``pip install bitsandbytes`` (its CPU backend) for QLoRA;
without it that row says why. The three methods run one after another, ``--repeat`` times, interleaved.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_base(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.checkpoint.tiny import llama_folder

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    llama_folder(folder, model=LlamaForCausalLM(cfg))  # q/k/v and gate/up share their global scale


def run(method: str, base: Path, tmp: Path, steps: int) -> list[dict] | str:
    from tests.ranks import free_port

    out = tmp / f"{method}_{{rank}}.json"
    log = tmp / f"{method}.log"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(ROOT / "bench" / "finetune_worker.py"), "--method", method, "--base", str(base), "--out", str(out),
           "--steps", str(steps)]
    env = {**__import__("os").environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=1800)
    if r.returncode:
        lines = [ln for ln in log.read_text().splitlines() if "Error" in ln or "error" in ln]
        return f"failed (exit {r.returncode}): {lines[-1][:300] if lines else 'see its log'}"
    return [json.loads(Path(str(out).replace("{rank}", str(k))).read_text()) for k in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="run the benchmark and write its raw output here")
    ap.add_argument("--table", help="print the markdown table of a kept --json output")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    if not args.json:
        ap.error("give --json OUT (run) or --table KEPT.json")
    from tqdm import tqdm

    tmp = Path(tempfile.mkdtemp(prefix="ds_nvfp4_finetune_"))
    write_base(tmp / "base")
    methods = ["bf16", "nvfp4", "qlora"]
    results: dict[str, list] = {m: [] for m in methods}
    for _ in tqdm(range(args.repeat), desc="rounds"):
        for m in tqdm(methods, desc="methods", leave=False):
            results[m].append(run(m, tmp / "base", tmp, args.steps))
    rows = {}
    for m, runs in results.items():
        ok = [r for r in runs if isinstance(r, list)]
        if not ok:
            rows[m] = {"error": runs[0]}
            continue
        rank0 = [r[0] for r in ok]
        steady = [statistics.median(r["step_seconds"][3:]) for r in rank0]
        rows[m] = {"bytes_rank0": rank0[0]["bytes"], "tokens_per_s": [r["tokens_per_step"] / s for r, s in
                                                                    zip(rank0, steady)],
                   "final_loss": [statistics.mean(r["losses"][-5:]) for r in rank0], "losses": rank0[0]["losses"],
                   "trainable": rank0[0]["trainable"]}
    ref = rows.get("bf16", {})
    for row in rows.values():
        if "tokens_per_s" in row and "tokens_per_s" in ref:
            row["speed_vs_bf16_lora"] = [a / b for a, b in zip(row["tokens_per_s"], ref["tokens_per_s"])]
            row["base_bytes_vs_bf16_lora"] = row["bytes_rank0"]["base_weights"] / ref["bytes_rank0"]["base_weights"]
    flags = Path("/proc/cpuinfo").read_text()
    cpu = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")), "?")
    out = {"command": " ".join(["python", *sys.argv]), "machine": {
        "cpu": cpu, "cores": __import__("os").cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags, "python": platform.python_version()}, "steps": args.steps,
        "repeat": args.repeat, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(table(out))


def table(out: dict) -> str:
    """The markdown table of a --json output: medians over the rounds (speed: ratio to BF16 LoRA of the same
    round)."""
    head = ("| method | base weights, bytes per rank | vs BF16 | model state (params + FP32 masters + Adam), bytes "
            "per rank | tokens/s vs BF16 LoRA (rounds) | loss, mean of the last 5 of "
            f"{out['steps']} steps |\n|---|---|---|---|---|---|")
    lines = [head]
    names = {"nvfp4": "ds_nvfp4: LoRA on the NVFP4 checkpoint", "bf16": "BF16 LoRA (same values, dequantized)",
             "qlora": "bitsandbytes QLoRA (NF4)"}
    for m, row in out["rows"].items():
        if "error" in row:
            lines.append(f"| {names[m]} | {row['error']} | | | | |")
            continue
        b = row["bytes_rank0"]
        speed = row.get("speed_vs_bf16_lora", [1.0])
        lines.append(f"| {names[m]} | {b['base_weights']:,} | {row.get('base_bytes_vs_bf16_lora', 1.0):.3f}x | "
                     f"{b['model_state']:,} | {statistics.median(speed):.2f}x ({', '.join(f'{x:.2f}' for x in speed)}) "
                     f"| {statistics.median(row['final_loss']):.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
