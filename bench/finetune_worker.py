"""One rank of bench/finetune.py: LoRA on one base representation under ZeRO-3, measured.

``deepspeed --num_gpus 2 bench/finetune_worker.py --method {nvfp4,bf16,qlora} --base FOLDER --out JSON``

- ``nvfp4``: ds_nvfp4, ``precision.base`` frozen from the NVFP4 checkpoint (each rank packs its slice of the codes;
  FP4 forward GEMMs, 1x16 blocks, NVFP4 gathers), model built under ``zero.Init``;
- ``bf16``: plain DeepSpeed, the base in BF16 (the checkpoint dequantized: the same values), ``zero.Init``;
- ``qlora``: plain DeepSpeed, every base Linear a bitsandbytes NF4 ``Linear4bit`` (``quant_storage`` BF16, as
  QLoRA under ZeRO-3 needs) quantized from the same dequantized weights; built whole on each rank, then partitioned.

Same LoRA (r 16 on every projection), data (byte-level Shakespeare), batch, learning rate and steps. Writes this
rank's bytes (base weights resident, and parameters + FP32 masters + Adam moments), step times and losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def ds_config(method: str, base: str, micro: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
           "bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if method == "nvfp4":
        cfg["precision"] = {"enabled": True, "weights": {"block": "1x16"}, "communication": {"all_gather": "nvfp4"},
                            "base": {"frozen": True, "checkpoint": base}}
    return cfg


def build(method: str, base: str, cfg: dict):
    import deepspeed
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_nvfp4.checkpoint.hf_nvfp4 import load_dequantized, open_nvfp4_checkpoint

    config = AutoConfig.from_pretrained(base)
    del config.quantization_config
    AutoModelForCausalLM.from_config(config)  # transformers' lazy imports outside zero.Init's tensor patches
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    if method == "qlora":
        import bitsandbytes as bnb

        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        load_dequantized(model, open_nvfp4_checkpoint(base))
        for name, m in list(model.named_modules()):
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
                q = bnb.nn.Linear4bit(m.in_features, m.out_features, bias=m.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4",
                                      quant_storage=torch.bfloat16)
                q.weight = bnb.nn.Params4bit(m.weight.data.float(), requires_grad=False, quant_type="nf4",
                                             quant_storage=torch.bfloat16).to("cpu")
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, q)
        return get_peft_model(model, lora)
    plain = {k: v for k, v in cfg.items() if k != "precision"}
    with deepspeed.zero.Init(config_dict_or_path=plain):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if method == "bf16":
        load_dequantized(model, open_nvfp4_checkpoint(base))
    model = get_peft_model(model, lora)  # ds_nvfp4 reads the base from the checkpoint itself
    return model


def state_bytes(engine, method: str) -> dict:
    """This rank's resident bytes: base weights, and parameters + FP32 masters + Adam moments."""
    opt = engine.optimizer
    store = getattr(getattr(engine, "ds_nvfp4", None), "store", None)
    packed = {id(e.param): e.q.nbytes for e in store.entries.values() if e.q is not None} if store else {}
    base = params = 0
    for name, p in engine.module.named_parameters():
        t = getattr(p, "ds_tensor", p)
        n = packed.get(id(p), t.numel() * t.element_size())
        params += n
        if not p.requires_grad and "base_layer" in name:
            base += n
            qs = getattr(p, "quant_state", None)  # bitsandbytes keeps its absmax per 64 elements beside the codes
            if qs is not None:
                base += qs.absmax.numel() * qs.absmax.element_size()
                params += qs.absmax.numel() * qs.absmax.element_size()
    masters = sum(t.numel() * t.element_size() for t in opt.fp32_partitioned_groups_flat)
    moments = sum(v.numel() * v.element_size() for s in opt.optimizer.state.values() for v in s.values()
                  if torch.is_tensor(v) and v.dim() > 0)
    return {"base_weights": base, "parameters": params, "fp32_masters": masters, "adam_moments": moments,
            "model_state": params + masters + moments}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=["nvfp4", "bf16", "qlora"], required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    import deepspeed

    import ds_nvfp4
    from ds_nvfp4.zero.teardown import destroy_at_exit
    deepspeed.init_distributed(dist_backend="gloo")
    destroy_at_exit()  # the BF16 method's plain deepspeed.initialize does not register it (zero/teardown.py)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    cfg = ds_config(args.method, args.base, args.micro)
    model = build(args.method, args.base, cfg)
    init = ds_nvfp4.initialize if args.method == "nvfp4" else deepspeed.initialize
    engine, *_ = init(model=model, config=cfg, model_parameters=[p for p in model.parameters() if p.requires_grad])
    train = torch.frombuffer(bytearray((ROOT / "data" / "shakespeare" / "train.bin").read_bytes()), dtype=torch.uint8)
    g = torch.Generator().manual_seed(1000 + rank)
    times, losses = [], []
    for _ in range(args.steps):
        start = torch.randint(0, len(train) - args.seq - 1, (args.micro,), generator=g)
        ids = torch.stack([train[s:s + args.seq] for s in start.tolist()]).long()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    out = {"method": args.method, "rank": rank, "world": world, "bytes": state_bytes(engine, args.method),
           "step_seconds": times, "losses": losses, "tokens_per_step": args.micro * args.seq * world,
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad and not hasattr(p, "ds_id"))
           or sum(int(p.ds_numel) for p in model.parameters() if p.requires_grad)}
    Path(args.out.replace("{rank}", str(rank))).write_text(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
