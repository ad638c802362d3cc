"""What the multi-rank tests share: a small model with every kind of layer, the preset configs, seeded batches,
full-tensor digests, the exactness check of packed weights, and the two scenarios several test files run
(``scenario_train``, ``scenario_save``) through :func:`tests.ranks.run_ranks`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

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
                                 scaling=weights.quantization()).dequantize(torch.bfloat16)
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

