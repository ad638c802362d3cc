"""Scenarios run on every rank by harness.run_ranks: ``python -m tests.zero.worker NAME OUT.json PARAMS``."""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path

import torch
from torch import nn

from ds_nvfp4.zero.shm import workspace_path

ROOT = Path(__file__).resolve().parents[2]


class Block(nn.Module):
    def __init__(self, d: int, checkpointed: bool = False) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.checkpointed = checkpointed

    def _f(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))

    def forward(self, x):
        if self.checkpointed and self.training:
            return torch.utils.checkpoint.checkpoint(self._f, x, use_reentrant=False)
        return self._f(x)


class Net(nn.Module):
    """Embedding, 3 blocks (one activation-checkpointed), an odd-shaped layer that stays BF16, a head."""

    def __init__(self, d: int = 64, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, checkpointed=(i == 1)) for i in range(3))
        self.odd = nn.Linear(d, 48)      # 48/2 ranks = 24 rows: a partition cuts 16x16 tiles -> stored BF16, reported
        self.mix = nn.Linear(48, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        h = self.embed(idx)
        for b in self.blocks:
            h = b(h)
        h = h + self.mix(self.odd(h))
        logits = self.lm_head(h).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def config(**over) -> dict:
    """A preset with overrides (``"a.b": value``). The presets' BF16 warm-up (``precision.schedule``) is dropped:
    these scenarios test FP4 from the first step; those about the schedule set their own."""
    cfg = json.loads((ROOT / "ds_configs" / over.pop("preset", "nvfp4_zero3_all_blocks_ablation.json")).read_text())
    cfg.get("precision", {}).pop("schedule", None)
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["gradient_accumulation_steps"] = over.pop("gas", 1)
    from ds_nvfp4.config import with_overrides

    return with_overrides(cfg, over)


def batch(step: int, rank: int, vocab: int = 128):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, vocab, (2, 24), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def digests(engine) -> dict[str, str]:
    """sha256 of every full FP32 master (bytes): a full-tensor comparison that fits in the JSON result."""
    import hashlib

    import deepspeed

    return {n: hashlib.sha256(deepspeed.utils.safe_get_full_fp32_param(q).detach().float().contiguous().cpu()
                              .numpy().tobytes()).hexdigest() for n, q in engine.module.named_parameters()}


def make_engine(cfg: dict, seed: int = 0):
    import ds_nvfp4

    torch.manual_seed(seed)
    model = Net()
    engine, *_ = ds_nvfp4.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train(engine, steps: range, rank: int, grads: dict | None = None) -> list[float]:
    """Train; with ``grads`` given, fill it with ``safe_get_full_grad`` facts of every FP4 Linear's weight at the
    last step (after the backward of the last micro-batch, before ``step()``, as DeepSpeed documents)."""
    import deepspeed

    from ds_nvfp4.nn import NVFP4Linear

    losses = []
    for step in steps:
        for micro in range(engine.gradient_accumulation_steps()):
            loss = engine(*batch(step * 10 + micro, rank))
            engine.backward(loss)
            if grads is not None and step == steps[-1] and micro == engine.gradient_accumulation_steps() - 1:
                for name, m in engine.module.named_modules():
                    if isinstance(m, NVFP4Linear):
                        g = deepspeed.utils.safe_get_full_grad(m.weight)
                        grads[name] = {"shape": list(g.shape) if g is not None else None,
                                       "finite": bool(g is not None and torch.isfinite(g).all()),
                                       "norm": float(g.float().norm()) if g is not None else 0.0}
            engine.step()
        losses.append(float(loss))
    return losses


def exactness(engine) -> dict:
    """For each converted weight: the BF16 weight gathered for the forward == dequant(quantize(full FP32 master))."""
    import deepspeed

    import ds_nvfp4
    from ds_nvfp4.nn import NVFP4Linear

    out = {}
    weights = engine.ds_nvfp4.precision.weights
    block = weights.block
    store = engine.ds_nvfp4.store
    if store is None:  # ZeRO 0-2 or BF16 storage: nothing is packed
        return out
    for name, m in engine.module.named_modules():
        if not isinstance(m, NVFP4Linear):
            continue
        master = deepspeed.utils.safe_get_full_fp32_param(m.weight)
        with deepspeed.zero.GatheredParameters([m.weight]):
            seen = m.weight.data.clone()
        want = ds_nvfp4.quantize(master, block=block, amax=master.abs().max(),
                                 **weights.quantization()).dequantize(torch.bfloat16)
        standard = ds_nvfp4.quantize(master, block=block, amax=master.abs().max()).dequantize(torch.bfloat16)
        packed = store.entries[id(m.weight)].packable
        out[name] = {"packed": packed, "equal": bool(torch.equal(seen, want)),
                     "standard": bool(torch.equal(seen, standard)), "checksum": float(seen.float().abs().sum())}
    return out


def scenario_train(rank: int, p: dict) -> dict:
    import ds_nvfp4
    from ds_nvfp4.nn import NVFP4Linear

    cfg = config(**p.get("config", {}))
    engine = make_engine(cfg)
    before = exactness(engine)
    grads: dict = {}
    losses = train(engine, range(p.get("steps", 6)), rank, grads)
    after = exactness(engine)
    rep = ds_nvfp4.storage_report(engine)
    shapes = {n: list(getattr(m.weight, "ds_shape", m.weight.shape)) for n, m in engine.module.named_modules()
              if n in grads}
    quantized = {n: m.weight_quantizations for n, m in engine.module.named_modules() if isinstance(m, NVFP4Linear)}
    return {"losses": losses, "before": before, "after": after, "report": rep.to_dict() if rep else None,
            "weight_quantizations": quantized,
            "grads": grads, "weight_shapes": shapes,
            "conversion": engine.ds_nvfp4.conversion.to_dict(), "kernel": engine.ds_nvfp4.selection.name,
            "recipe": engine.ds_nvfp4.precision.describe_recipe()}


def scenario_checkpoint(rank: int, p: dict) -> dict:
    """Train 6 steps saving at 3; a fresh engine loads step 3 and trains 4..6: losses must match exactly. Records
    when each file of the save was renamed into place (``os.replace``, wall clock in ns) on this rank."""
    import time

    import deepspeed

    cfg = config(**p.get("config", {}))
    ckpt = p["dir"]
    e1 = make_engine(copy.deepcopy(cfg))
    first = train(e1, range(3), rank)
    w3 = {n: float(deepspeed.utils.safe_get_full_fp32_param(q).double().sum()) for n, q in
          e1.module.named_parameters()}
    d3 = digests(e1)
    renamed, real_replace = [], os.replace

    def replace(src, dst, *a, **kw):
        out = real_replace(src, dst, *a, **kw)
        renamed.append((time.time_ns(), os.path.basename(str(dst))))
        return out

    os.replace = replace
    e1.save_checkpoint(ckpt, tag="step3")
    os.replace = real_replace
    rest = train(e1, range(3, 6), rank)
    w_ref = {n: float(deepspeed.utils.safe_get_full_fp32_param(q).double().sum()) for n, q in
             e1.module.named_parameters()}
    d_ref = digests(e1)
    e1.save_16bit_model(ckpt, "model16.bin")
    e2 = make_engine(copy.deepcopy(cfg), seed=123)  # different init: everything must come from the checkpoint
    e2.load_checkpoint(ckpt, tag="step3")
    resumed = train(e2, range(3, 6), rank)
    w_res = {n: float(deepspeed.utils.safe_get_full_fp32_param(q).double().sum()) for n, q in
             e2.module.named_parameters()}
    return {"first": first, "rest": rest, "resumed": resumed, "w_ref": w_ref, "w_res": w_res, "w3": w3,
            "d3": d3, "d_ref": d_ref, "d_res": digests(e2), "renamed": renamed,
            "exact_after_resume": exactness(e2)}


def scenario_modify(rank: int, p: dict) -> dict:
    """GatheredParameters(modifier_rank=0): unchanged weights keep their bytes; changed ones are re-packed."""
    import deepspeed

    import ds_nvfp4

    engine = make_engine(config())
    store = engine.ds_nvfp4.store
    w = engine.module.blocks[0].fc1.weight
    e = store.entries[id(w)]
    def snapshot():
        return e.q.wire().clone(), e.codes.agreed_amax.clone()

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    before = snapshot()
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        pass
    kept = same(snapshot(), before)
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        if rank == 0:
            w.data[0, :16] = 1.0  # an outlier: new amax, new codes everywhere
        full_new = w.data.clone()
    torch.distributed.broadcast(full_new, src=0)  # what every rank holds after the context's broadcast
    with deepspeed.zero.GatheredParameters([w]):
        seen = w.data.clone()
    want = ds_nvfp4.quantize(full_new.float(), block="16x16", amax=full_new.float().abs().max()).dequantize()
    return {"kept_bytes": kept, "changed_bytes": not same(snapshot(), before),
            "repacked_equal": bool(torch.equal(seen, want))}


def scenario_save(rank: int, p: dict) -> dict:
    """Train 3 steps and save a checkpoint (for the universal-checkpoint resume on another rank count)."""
    import deepspeed

    e = make_engine(config())
    losses = train(e, range(3), rank)
    e.save_checkpoint(p["dir"], tag="step3")
    w = {n: float(deepspeed.utils.safe_get_full_fp32_param(q).double().sum()) for n, q in e.module.named_parameters()}
    if p.get("dump_forward_weights"):  # what the forward multiplies, for the export test's reference
        from ds_nvfp4.nn import NVFP4Linear

        fp4 = {n: m for n, m in e.module.named_modules() if isinstance(m, NVFP4Linear)}
        with deepspeed.zero.GatheredParameters([m.weight for m in fp4.values()]):
            seen = {n: m.weight.detach().clone() for n, m in fp4.items()}
        if rank == 0:
            torch.save(seen, p["dump_forward_weights"])
    return {"losses": losses, "w": w, "d": digests(e)}


def scenario_load_universal(rank: int, p: dict) -> dict:
    """Load a universal checkpoint written by another number of ranks, check the masters, train on."""
    import deepspeed

    e = make_engine(config(**{"checkpoint.load_universal": True}), seed=321)
    e.load_checkpoint(p["dir"], tag=p["tag"])
    w = {n: float(deepspeed.utils.safe_get_full_fp32_param(q).double().sum()) for n, q in e.module.named_parameters()}
    d = digests(e)
    losses = train(e, range(3, 5), rank)
    return {"losses": losses, "w": w, "d": d, "exact": exactness(e)}


def scenario_args_form(rank: int, p: dict) -> dict:
    """`deepspeed --deepspeed_config FILE` style: the config comes from args; a BF16 preset is plain DeepSpeed."""
    import argparse

    import ds_nvfp4
    from ds_nvfp4.nn import NVFP4Linear

    out = {}
    for preset in ("nvfp4_zero3.json", "bf16_zero3.json"):
        torch.manual_seed(0)
        model = Net()
        args = argparse.Namespace(deepspeed_config=str(ROOT / "ds_configs" / preset), local_rank=rank)
        engine, *_ = ds_nvfp4.initialize(args=args, model=model, model_parameters=model.parameters())
        loss = engine(*batch(0, rank))
        engine.backward(loss)
        engine.step()
        out[preset] = {"has_state": hasattr(engine, "ds_nvfp4"),
                       "fp4_layers": sum(isinstance(m, NVFP4Linear) for m in engine.module.modules()),
                       "loss": float(loss), "report": bool(ds_nvfp4.storage_report(engine))}
    return out


def scenario_fused(rank: int, p: dict) -> dict:
    """``modules.fuse: [["fc1", "fc2"]]``: each block's fc1/fc2 share one amax (packed store), or are unfused with
    a note (ZeRO-3 with BF16 storage). Reports, per layer, whether the forward's weight equals the quantized
    master with the group's amax and with its own."""
    import deepspeed

    import ds_nvfp4

    cfg = config(**{"precision.modules.fuse": [["fc1", "fc2"]], **p.get("config", {})})
    engine = make_engine(cfg)
    train(engine, range(2), rank)
    state = engine.ds_nvfp4
    masters = {n: deepspeed.utils.safe_get_full_fp32_param(m.weight) for n, m in engine.module.named_modules()
               if n.endswith((".fc1", ".fc2"))}
    out: dict = {"fused_groups": state.conversion.fused_groups, "notes": state.conversion.notes, "layers": {}}
    for name, master in masters.items():
        m = engine.module.get_submodule(name)
        peer = masters[name[:-1] + ("2" if name.endswith("1") else "1")]
        with deepspeed.zero.GatheredParameters([m.weight]):
            seen = m.weight.data.clone()

        def q(amax, w=master):
            return ds_nvfp4.quantize(w, block="16x16", amax=amax).dequantize(torch.bfloat16)

        out["layers"][name] = {"group": bool(torch.equal(seen, q(torch.maximum(master.abs().max(),
                                                                               peer.abs().max())))),
                               "own": bool(torch.equal(seen, q(master.abs().max())))}
    return out


def scenario_nonfinite(rank: int, p: dict) -> dict:
    """NaN injected into ``blocks.1.fc1``'s input on rank 1 only, at the given steps (1-based).

    Records where ``NonFiniteError`` was raised (every rank must raise: no hang), whether the FP32 masters are
    those of the last good step, and the skipped-step count.
    """
    import deepspeed

    import ds_nvfp4

    cfg = config(preset=p.get("preset", "nvfp4_zero3.json"), **p.get("config", {}))
    engine = make_engine(cfg)
    bad = set(p["bad_steps"])

    def poison(module, args):  # block 1 is activation-checkpointed: its recomputation is poisoned too
        if module.training and engine.global_steps + 1 in bad and rank == 1:
            return (args[0] * float("nan"),)
        return None

    engine.module.get_submodule("blocks.1.fc1").register_forward_pre_hook(poison)

    def masters() -> dict:
        return {n: deepspeed.utils.safe_get_full_fp32_param(q).clone() for n, q in engine.module.named_parameters()}

    out: dict = {"losses": [], "error": None, "raised_at": None, "unchanged_after_skip": []}
    prev = masters()
    for step in range(1, p.get("steps", 6) + 1):
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        try:
            engine.step()
        except ds_nvfp4.NonFiniteError as exc:
            now = masters()
            out.update(error=str(exc), raised_at=step, masters_unchanged=all(torch.equal(prev[n], now[n])
                                                                             for n in prev))
            break
        now = masters()
        if step in bad:
            out["unchanged_after_skip"].append(all(torch.equal(prev[n], now[n]) for n in prev))
        else:
            out["losses"].append(float(loss))
        prev = now
    out["skipped"] = engine.ds_nvfp4.skipped_steps
    out["all_masters_finite"] = all(bool(torch.isfinite(v).all()) for v in masters().values())
    return out


def scenario_init_corpus(rank: int, p: dict) -> dict:
    """``ds_nvfp4.initialize`` on each named config: ``{name: None (ok) or "ErrorType: message"}``."""
    import ds_nvfp4

    out = {}
    for name, cfg in p["configs"].items():
        torch.manual_seed(0)
        model = Net()
        try:
            ds_nvfp4.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            out[name] = None
        except Exception as exc:  # the property compares success with validate, whatever the error type
            out[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"results": out}


def scenario_comm_dtype(rank: int, p: dict) -> dict:
    """The dtype DeepSpeed's engine reduce-scatters gradients in, for each precision.communication.reduce_scatter."""
    out = {}
    for rs in ("bf16", "fp32"):
        engine = make_engine(config(**{"precision.communication.reduce_scatter": rs}))
        out[rs] = str(engine.communication_data_type)
        train(engine, range(1), rank)
    return out


def scenario_traffic(rank: int, p: dict) -> dict:
    """Per configuration: the payload each collective moved in one step (counted by wrapping torch.distributed)
    and ds_nvfp4.zero.traffic's analytic bytes. With DeepSpeed's default live/prefetch limits this small model is
    gathered whole once per step (one pass)."""
    from bench import comm_count
    from ds_nvfp4.zero.traffic import engine_traffic

    out = {}
    for name, over in {"bf16": {"preset": "bf16_zero3.json"}, "nvfp4_bf16_gather": {},
                       "nvfp4_nvfp4_gather": {"precision.communication.all_gather": "nvfp4"},
                       "nvfp4_fp32_rs": {"precision.communication.all_gather": "nvfp4",
                                         "precision.communication.reduce_scatter": "fp32",
                                         "communication_data_type": "fp32"}}.items():
        engine = make_engine(config(**over))
        train(engine, range(2), rank)
        comm_count.reset()
        train(engine, range(2, 3), rank)
        out[name] = {"counted": comm_count.by_family(), "analytic": engine_traffic(engine).as_dict()}
    return out


def scenario_variants(rank: int, p: dict) -> dict:
    """Several configs in one launch (process start-up dominates on 2 cores): per variant, exactness before and
    after training, losses, storage report; with ``save``, the first variant is checkpointed (tag step3)."""
    out = {}
    for i, (name, overrides) in enumerate(p["variants"].items()):
        engine = make_engine(config(**overrides))
        before = exactness(engine)
        losses = train(engine, range(p.get("steps", 3)), rank)
        rep = engine.ds_nvfp4.store.report()
        out[name] = {"before": before, "after": exactness(engine), "losses": losses, "report": rep.to_dict()}
        if i == 0 and p.get("save"):
            engine.save_checkpoint(p["save"], tag="step3")
            out[name]["d"] = digests(engine)
    return out


def scenario_plain_deepspeed(rank: int, p: dict) -> dict:
    """An unmodified script: model built under ``deepspeed.zero.Init``, then plain ``deepspeed.initialize``.

    The start-up hook (ds_nvfp4_autohook.pth) must route it to ds_nvfp4 when the config has a ``precision``
    section, refuse an invalid section, and leave DeepSpeed alone without one or with ``DS_NVFP4_AUTO=0``.
    """
    import deepspeed

    from ds_nvfp4.config import ConfigError

    def build(cfg: dict) -> nn.Module:
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            return Net()

    out: dict = {"wrapped": hasattr(deepspeed.initialize, "__ds_nvfp4_original__")}
    cfg = config()
    model = build(cfg)
    out["partitioned_at_construction"] = all(hasattr(q, "ds_id") and q.numel() == 0
                                             for q in model.blocks[0].fc1.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out["has_state"] = hasattr(engine, "ds_nvfp4")
    out["losses"] = train(engine, range(4), rank)
    rep = engine.ds_nvfp4.store.report() if out["has_state"] and engine.ds_nvfp4.store else None
    out["report"] = rep.to_dict() if rep else None
    out["exact"] = exactness(engine) if out["has_state"] else {}
    import argparse

    import ds_nvfp4

    # the most common call: deepspeed.initialize(args=cmd_args, model=...) with args.deepspeed_config, no config=
    path = Path(p["dir"]) / f"ds_rank{rank}.json"
    path.write_text(json.dumps(config()))
    by_args, *_ = deepspeed.initialize(args=argparse.Namespace(deepspeed_config=str(path), local_rank=rank),
                                       model=build(cfg))
    out["args_keyword_state"] = hasattr(by_args, "ds_nvfp4")
    explicit, *_ = ds_nvfp4.initialize(model=build(cfg), config=config())
    out["explicit_losses"] = train(explicit, range(4), rank)

    bad = config()
    bad["precision"]["weights"] = {"storage": "fp8"}
    try:
        deepspeed.initialize(model=Net(), model_parameters=Net().parameters(), config=bad)
        out["invalid"] = "no error"
    except ConfigError as exc:
        out["invalid"] = str(exc)

    plain = config()
    del plain["precision"]
    e2, *_ = deepspeed.initialize(model=build(plain), config=plain)
    out["no_section_state"] = hasattr(e2, "ds_nvfp4")
    typo = config()
    typo["precison"] = typo.pop("precision")  # DeepSpeed ignores it: a BF16 run, said loudly on rank 0
    import contextlib
    import io

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        e4, *_ = deepspeed.initialize(model=build(typo), config=typo)
    out["typo_state"], out["typo_said"] = hasattr(e4, "ds_nvfp4"), said.getvalue()
    os.environ["DS_NVFP4_AUTO"] = "0"
    e3, *_ = deepspeed.initialize(model=build(cfg), config=config())
    out["opt_out_state"] = hasattr(e3, "ds_nvfp4")
    return out


def scenario_weight_cache(rank: int, p: dict) -> dict:
    """ZeRO-2, gradient accumulation 2, block 1 activation-checkpointed, an evaluation forward after the last step:
    per FP4 layer, how many times its weight was quantized, and the losses (cache on or off: same codes)."""
    import os

    from ds_nvfp4.nn import NVFP4Linear

    os.environ["DS_NVFP4_WEIGHT_CACHE"] = p["cache"]
    engine = make_engine(config(preset="nvfp4_zero2.json", gas=2))
    losses = train(engine, range(3), rank)
    engine.eval()
    with torch.no_grad():
        losses.append(float(engine(*batch(99, rank))))
    engine.train()
    counts = {n: m.weight_quantizations for n, m in engine.module.named_modules() if isinstance(m, NVFP4Linear)}
    return {"losses": losses, "counts": counts, "notes": engine.ds_nvfp4.conversion.notes}


def scenario_schedule(rank: int, p: dict) -> dict:
    """precision.schedule on 7 steps: 1-2 BF16 warm-up, 3-4 FP4, 5-7 the late switch. Checkpoints at steps 2, 4 and
    5 (either side of each switch); a fresh engine resumes from each and trains to step 7. Plus the first 2 steps of
    a plain BF16 engine from the same initial weights."""
    import ds_nvfp4

    sched = {"bf16_warmup_steps": 2, "bf16_from": p.get("bf16_from", 5), "bf16_gemms": p.get("gemms", "forward")}
    cfg = config(**{"precision.schedule": sched, **p.get("config", {})})
    ckpt = p["dir"]
    e1 = make_engine(copy.deepcopy(cfg))
    phases, packed, bf16_only, losses, exact = [], [], [], [], []
    for step in range(7):
        store = e1.ds_nvfp4.store
        phases.append(e1.ds_nvfp4.schedule.current.name)
        packed.append(ds_nvfp4.storage_report(e1).packed_params if store is not None else None)
        bf16_only.append(e1.module.blocks[1].fc1.bf16_only)
        exact.append(all(v["equal"] for v in exactness(e1).values() if v["packed"]) if store and store.packed
                     else None)
        losses += train(e1, range(step, step + 1), rank)
        if step + 1 in (2, 4, 5):
            e1.save_checkpoint(ckpt, tag=f"step{step + 1}")
    base = make_engine(config(preset="bf16_zero3.json"))
    bf16 = train(base, range(2), rank)
    resumed = {}
    cfg.pop("csv_monitor", None)  # the monitor's rows are those of the uninterrupted run
    for tag in (2, 4, 5):
        e = make_engine(copy.deepcopy(cfg), seed=123)
        e.load_checkpoint(ckpt, tag=f"step{tag}")
        resumed[tag] = train(e, range(tag, 7), rank)
    return {"phases": phases, "packed": packed, "bf16_only": bf16_only, "exact": exact, "losses": losses,
            "bf16": bf16, "resumed": resumed, "schedule": e1.ds_nvfp4.schedule.to_dict(),
            "share": e1.ds_nvfp4.fp4_gemm_share(7), "notes": e1.ds_nvfp4.conversion.notes}


def scenario_lr_decay(rank: int, p: dict) -> dict:
    """``bf16_from: "lr_decay"`` with a client LambdaLR (``p["factors"]``: the learning-rate factor of each step):
    the phase of each of 7 steps, what was found, the warnings; with ``p["resume"]``, fresh engines resumed from
    checkpoints at steps 4 and 6 train to step 7 (phases and losses)."""
    import logging

    import ds_nvfp4

    factors = p["factors"]
    cfg = config(**{"precision.schedule": {"bf16_from": "lr_decay"}})
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("ds_nvfp4").addHandler(Keep(level=logging.WARNING))

    def engine(seed: int = 0):
        torch.manual_seed(seed)
        model = Net()
        e, *_ = ds_nvfp4.initialize(
            model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: factors[min(i, 6)]))
        return e

    e1 = engine()
    phases, losses = [], []
    for step in range(7):
        phases.append(e1.ds_nvfp4.schedule.current.name)
        losses += train(e1, range(step, step + 1), rank)
        if p.get("resume") and step + 1 in (4, 6):
            e1.save_checkpoint(p["dir"], tag=f"step{step + 1}")
    out = {"phases": phases, "losses": losses, "schedule": e1.ds_nvfp4.schedule.to_dict(), "warnings": warnings,
           "notes": e1.ds_nvfp4.conversion.notes}
    if p.get("resume"):
        out["resumed"] = {}
        for tag in (4, 6):
            e = engine(seed=123)
            e.load_checkpoint(p["dir"], tag=f"step{tag}")
            got_phases, got_losses = [], []
            for step in range(tag, 7):
                got_phases.append(e.ds_nvfp4.schedule.current.name)
                got_losses += train(e, range(step, step + 1), rank)
            out["resumed"][tag] = {"phases": got_phases, "losses": got_losses}
    return out


def scenario_spike_guard(rank: int, p: dict) -> dict:
    """``schedule.spike_guard`` (window 3, ratio 1.5, 2 BF16 steps, 1 episode) on 9 steps of packed ZeRO-3. Rank 1
    alone multiplies its loss by 8 at steps 6 and 9 (``p["spikes"]``), so only the pooled loss makes rank 0 see the
    spike: steps 7-8 must run BF16 on both ranks, the spike at step 9 finds the budget spent. A fresh engine resumed
    from the checkpoint at step 7 (inside the episode) must repeat the phases and losses of steps 8-9."""
    import logging

    import ds_nvfp4

    guard = {"window": 3, "loss_ratio": 1.5, "bf16_steps": 2, "max_episodes": 1}
    cfg = config(**{"precision.schedule": {"spike_guard": guard}, **p.get("config", {})})
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("ds_nvfp4").addHandler(Keep(level=logging.WARNING))

    def run(engine, steps: range) -> tuple[list[str], list[float], list, list[bool]]:
        phases, losses, packed, bf16_only = [], [], [], []
        for step in steps:
            phases.append(engine.ds_nvfp4.schedule.current.name)
            report = ds_nvfp4.storage_report(engine)  # None below ZeRO-3: DeepSpeed stores the weights
            packed.append(report.packed_params if report is not None else 0)
            bf16_only.append(engine.module.blocks[1].fc1.bf16_only)
            loss = engine(*batch(step, rank))
            if rank == 1 and step + 1 in p["spikes"]:
                loss = loss * 8.0
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            if step + 1 == 7:
                engine.save_checkpoint(p["dir"], tag="step7")
        return phases, losses, packed, bf16_only

    e1 = make_engine(copy.deepcopy(cfg))
    phases, losses, packed, bf16_only = run(e1, range(9))
    out = {"phases": phases, "losses": losses, "packed": packed, "bf16_only": bf16_only, "warnings": warnings,
           "schedule": e1.ds_nvfp4.schedule.to_dict(), "share": e1.ds_nvfp4.fp4_gemm_share(9),
           "share_planned": e1.ds_nvfp4.schedule.plan.fp4_share(
               9, sum(d.params for d in e1.ds_nvfp4.conversion.layers if d.fp4),
               sum(d.params for d in e1.ds_nvfp4.conversion.layers)),
           "notes": e1.ds_nvfp4.conversion.notes}
    cfg.pop("csv_monitor", None)  # the monitor's rows are those of the uninterrupted run
    e2 = make_engine(copy.deepcopy(cfg), seed=123)
    e2.load_checkpoint(p["dir"], tag="step7")
    got_phases, got_losses, _, _ = run(e2, range(7, 9))
    out["resumed"] = {"phases": got_phases, "losses": got_losses}
    return out


def _unmanaged_engine(p: dict, cache: str, **over):
    os.environ["DS_NVFP4_WEIGHT_CACHE"] = cache
    cfg = config(preset=p["preset"], gas=2, managed_gradient_accumulation=False, **over)
    return make_engine(cfg)


def _unmanaged_train(engine, steps: range, rank: int, poison_at: int | None = None) -> list[float]:
    """``managed_gradient_accumulation: false``: the caller owns the boundary, two backwards then one step()."""
    if poison_at is not None:
        def poison(module, args):
            if module.training and engine.global_steps + 1 == poison_at and rank == 1:
                return (args[0] * float("nan"),)
            return None

        engine.module.get_submodule("blocks.1.fc1").register_forward_pre_hook(poison)
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(2):
            idx, tgt = batch(step * 10 + micro, rank)
            loss = engine(idx, tgt)
            engine.backward(loss)
            total += float(loss.detach()) / 2
        engine.step()
        losses.append(total)
    return losses


def scenario_unmanaged(rank: int, p: dict) -> dict:
    """Every feature with ``managed_gradient_accumulation: false`` (DeepSpeed's boundary probe is False outside
    step()): weight cache on and off give the same losses; the schedule changes phase at its steps; the monitor gets
    the statistics; a NaN raises NonFiniteError at its step on every rank."""
    import ds_nvfp4

    out: dict = {}
    for cache in ("1", "0"):
        engine = _unmanaged_engine(p, cache)
        out[f"losses_cache{cache}"] = _unmanaged_train(engine, range(4), rank)
        out[f"quantizations_cache{cache}"] = engine.module.blocks[1].fc1.weight_quantizations
    engine = _unmanaged_engine(p, "1", **{"precision.schedule": {"bf16_warmup_steps": 1, "bf16_from": 4},
                                          "precision.monitor": {"enabled": True, "interval": 1},
                                          "csv_monitor": {"enabled": True, "output_path": p["dir"],
                                                          "job_name": "job"}})
    phases = []
    for step in range(4):
        phases.append(engine.ds_nvfp4.schedule.current.name)
        _unmanaged_train(engine, range(step, step + 1), rank)
    out["phases"] = phases
    out["global_steps"] = engine.global_steps
    out["order"] = engine.ds_nvfp4.lifecycle.order
    engine = _unmanaged_engine(p, "1")
    try:
        _unmanaged_train(engine, range(5), rank, poison_at=3)
        out["error"] = None
    except ds_nvfp4.NonFiniteError as exc:
        out["error"], out["raised_at"] = str(exc), engine.global_steps
    return out


class _Embed(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)

    def forward(self, idx):
        return self.embed(idx)


class _Head(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64) -> None:
        super().__init__()
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, h):
        return self.lm_head(h).float()


def _pipe_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _pipeline_engine(p: dict, cache: str = "1", **over):
    from deepspeed.pipe import LayerSpec, PipelineModule

    import ds_nvfp4

    os.environ["DS_NVFP4_WEIGHT_CACHE"] = cache
    torch.manual_seed(0)
    specs = [LayerSpec(_Embed)] + [LayerSpec(Block, 64) for _ in range(4)] + [LayerSpec(_Head)]
    model = PipelineModule(layers=specs, num_stages=2, loss_fn=_pipe_loss, partition_method="uniform")
    cfg = config(preset="nvfp4_zero2.json", gas=2, **{"zero_optimization.stage": 1, **over})
    engine, *_ = ds_nvfp4.initialize(model=model, model_parameters=[q for q in model.parameters()
                                                                    if q.requires_grad], config=cfg)
    return engine


def _pipe_data(rank_seed: int = 0):
    step = 0
    while True:
        idx, tgt = batch(step, 0)  # every stage draws the same batches (the first reads inputs, the last labels)
        step += 1
        yield idx, tgt


def scenario_pipeline(rank: int, p: dict) -> dict:
    """A PipelineModule in 2 stages (ZeRO-1): FP4 layers per stage, the lifecycle through train_batch (cache on and
    off equal, schedule phases, resume from a checkpoint), and a NaN stops every rank with NonFiniteError."""
    import ds_nvfp4
    from ds_nvfp4.nn import NVFP4Linear

    out: dict = {}
    for cache in ("1", "0"):
        engine = _pipeline_engine(p, cache)
        data = _pipe_data()
        out[f"losses_cache{cache}"] = [float(engine.train_batch(data)) for _ in range(4)]
    out["conversion"] = engine.ds_nvfp4.conversion.to_dict()
    out["fp4_layers"] = sorted(n for n, m in engine.module.named_modules() if isinstance(m, NVFP4Linear))
    out["type"] = type(engine).__name__
    out["seam_scopes"] = list(engine.ds_nvfp4.seam_scopes)
    out["stats_when_monitor_off"] = engine.ds_nvfp4.stats is None
    # the spike guard reads train_batch's loss (a PipelineEngine's backward is internal): its history is that loss
    sched = {"bf16_warmup_steps": 1, "spike_guard": {}}
    engine = _pipeline_engine(p, "1", **{"precision.schedule": sched})
    data = _pipe_data()
    phases, losses = [], []
    for step in range(4):
        phases.append(engine.ds_nvfp4.schedule.current.name)
        losses.append(float(engine.train_batch(data)))
        if step == 1:
            engine.save_checkpoint(p["dir"], tag="step2")
    out["phases"], out["schedule_losses"] = phases, losses
    out["guard"] = engine.ds_nvfp4.schedule.to_dict()["spike_guard"]
    resumed = _pipeline_engine(p, "1", **{"precision.schedule": sched})
    resumed.load_checkpoint(p["dir"], tag="step2")
    data = _pipe_data()
    for _ in range(2):  # the batches of steps 1-2, consumed
        next(data), next(data)
    out["resumed_losses"] = [float(resumed.train_batch(data)) for _ in range(2)]
    engine = _pipeline_engine(p, "1")
    layer = next(m for m in engine.module.modules() if isinstance(m, NVFP4Linear))
    bad = {3}

    def poison(module, args):
        return (args[0] * float("nan"),) if module.training and engine.global_steps + 1 in bad else None

    if rank == 0:
        layer.register_forward_pre_hook(poison)
    data = _pipe_data()
    try:
        for _ in range(5):
            engine.train_batch(data)
        out["error"] = None
    except ds_nvfp4.NonFiniteError as exc:
        out["error"], out["raised_at"] = str(exc), engine.global_steps
    return out


def scenario_families(rank: int, p: dict) -> dict:
    """Each transformers family of tests/integrations/families.py under plain ``deepspeed.initialize`` (the start-up
    hook), ZeRO-3 with packed storage, 3 steps: what was converted, storage, exactness of every packed weight
    (experts per expert matrix), losses."""
    import deepspeed

    import ds_nvfp4
    from ds_nvfp4.nn.module import FP4Module
    from tests.integrations.families import build

    out = {}
    for name in p["families"]:
        # every block FP4 here: the test is about which modules can be, not about the edge-block recipe
        cfg = config(preset="nvfp4_zero3.json", **{"precision.modules.keep_first_blocks_bf16": 0,
                                                  "precision.modules.keep_last_fraction_bf16": 0.0})
        model = build(name)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            ids = torch.randint(3, 256, (2, 16), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        block = engine.ds_nvfp4.precision.weights.block
        group_of = {n: g for g in engine.ds_nvfp4.conversion.fused_groups for n in g}
        exact = {}
        for mname, m in engine.module.named_modules():
            if not isinstance(m, FP4Module):
                continue
            for pname, param, codes in m.fp4_weights():
                if not engine.ds_nvfp4.store.entries[id(param)].packable:
                    continue
                master = deepspeed.utils.safe_get_full_fp32_param(param)
                if codes.stored_shape is not None:  # experts stacked in a 2-D parameter (DBRX): one matrix each
                    master = master.view(codes.stored_shape)
                with deepspeed.zero.GatheredParameters([param]):
                    seen = param.data.clone().view(master.shape)
                # one amax per expert matrix; a fused group's members (q, k, v) share the group's
                peers = [deepspeed.utils.safe_get_full_fp32_param(engine.module.get_submodule(n).weight)
                         for n in group_of.get(mname, [mname])] if master.dim() == 2 else [master]
                shared = torch.stack([w.abs().max() for w in peers]).max() if master.dim() == 2 else None
                mats = master if master.dim() == 3 else master[None]
                want = torch.stack([ds_nvfp4.quantize(w, block=block, amax=w.abs().max() if shared is None
                                                      else shared).dequantize(torch.bfloat16)
                                    for w in mats]).reshape(seen.shape)
                exact[f"{mname}.{pname}"] = bool(torch.equal(seen, want))
        rep = ds_nvfp4.storage_report(engine)
        out[name] = {"losses": losses, "exact": exact, "conversion": engine.ds_nvfp4.conversion.to_dict(),
                     "report": rep.to_dict(), "type": type(engine).__name__}
    return out


def scenario_reference_moe(rank: int, p: dict) -> dict:
    """The reference MoE GPT through ``ds_nvfp4.initialize`` with no leaf modules set by the caller: each rank routes
    its own tokens (few, so some experts get none and the ranks run different experts), in training and in eval
    forwards. Without ZeRO-3 leaf modules the ranks' module traces differ and they wait on each other forever."""
    import ds_nvfp4
    from ds_nvfp4.evaluation.gpt import GPT, model_spec

    torch.manual_seed(0)
    model = GPT.from_spec(model_spec("moe-1m"), 16)
    cfg = config(preset="nvfp4_zero3.json", **{"precision.schedule.bf16_warmup_steps": 0})
    engine, *_ = ds_nvfp4.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    hit, losses = [], []
    engine.module.blocks[1].moe.experts.register_forward_pre_hook(
        lambda m, args: hit.append(sorted(set(args[1].flatten().tolist()))))
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randint(0, 256, (1, 2 + 3 * rank), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).view(-1, 256), x.view(-1)) + 0.01 * engine.module.aux_loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.eval()
    with torch.no_grad():
        for i in range(4):
            g = torch.Generator().manual_seed(1000 + 10 * i + rank)
            engine(torch.randint(0, 256, (1, 1 + rank), generator=g))
    return {"losses": losses, "notes": engine.ds_nvfp4.conversion.notes, "hit": hit,
            "fp4_experts": [d["name"] for d in engine.ds_nvfp4.conversion.to_dict()["layers"]
                            if d["kind"] == "experts" and d["fp4"]]}


def main() -> None:
    name, out, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if params.get("count_collectives"):
        from bench import comm_count

        comm_count.install()  # before DeepSpeed builds its backend, which captures the gather/scatter functions
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    segment = workspace_path(rank, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    shm_created = segment.exists()  # DeepSpeed's CPU shm all-reduce made it in init_distributed
    result = globals()[f"scenario_{name}"](rank, params)
    result["rank"] = rank
    result["shm_segment"] = {"created": shm_created, "left_behind": segment.exists()}
    result["finite"] = all(math.isfinite(v) for v in result.get("losses", [0.0]))
    Path(out).write_text(json.dumps(result))
    torch.distributed.barrier()




if __name__ == "__main__":
    main()
