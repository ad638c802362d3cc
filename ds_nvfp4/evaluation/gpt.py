"""The reference GPT of the evaluation runs (nanoGPT-style), its deterministic batches and its held-out evaluation.

Imported by ``launch/train.py`` (which trains it under DeepSpeed), the fine-tunes and the linear probe (which load
its checkpoints). Byte-level (vocabulary 256); pre-LN blocks of causal SDPA attention and a GELU MLP; the LM head
tied to the embedding (ds_nvfp4 keeps it BF16 and says why).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# name: (layers, d_model, heads); ~1M (CI), 5M, 10M, 20M, 30M, 100M parameters with a 256-byte vocabulary
PRESETS = {"1m": (5, 128, 2), "5m": (6, 256, 4), "10m": (8, 320, 5), "20m": (8, 448, 7), "30m": (10, 512, 8),
           "100m": (14, 768, 12)}


# ------------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-LN transformer block: causal SDPA attention + GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # attention BMMs stay BF16
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: ds_nvfp4 keeps it BF16 and says so
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            h = blk(h)
        return self.lm_head(self.ln_f(h)).float()  # [B, T, 256] logits


# -------------------------------------------------------------------------------------------------- data
def get_batch(data: np.ndarray, seed: int, step: int, rank: int, batch: int, seq: int) -> tuple[torch.Tensor, ...]:
    """Deterministic batch for (seed, step, rank): identical for the BF16 and NVFP4 runs."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    ix = torch.randint(len(data) - seq - 1, (batch,), generator=g).tolist()
    x = torch.stack([torch.from_numpy(data[i:i + seq].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq].astype(np.int64)) for i in ix])
    return x, y


@torch.no_grad()
def evaluate(engine, val: np.ndarray, batches: int, batch: int, seq: int, rank: int, world: int) -> dict:
    """Validation loss (nats/byte), perplexity, bits per byte and next-byte accuracy on fixed held-out windows."""
    engine.eval()
    stride = (len(val) - seq - 1) // (batches * batch)
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, tokens
    per_batch = []
    # Every rank runs the same number of forwards: under ZeRO-3 each forward gathers weights collectively, so a
    # rank with one forward fewer (batches not a multiple of world) would leave the others waiting forever.
    # A rank without a batch of its own in the last round runs batch 0 again and discards the result.
    for b in range(rank, -(-batches // world) * world, world):
        real = b < batches
        starts = [((b if real else 0) * batch + j) * stride for j in range(batch)]
        x = torch.stack([torch.from_numpy(val[s:s + seq].astype(np.int64)) for s in starts]).to(engine.device)
        y = torch.stack([torch.from_numpy(val[s + 1:s + 1 + seq].astype(np.int64)) for s in starts]).to(engine.device)
        logits = engine(x)
        if not real:
            continue
        loss = F.cross_entropy(logits.view(-1, 256), y.view(-1), reduction="sum").double().cpu()
        sums += torch.stack([loss, (logits.argmax(-1) == y).sum().double().cpu(), torch.tensor(float(y.numel()))])
        per_batch.append((b, float(loss) / y.numel()))
    if world > 1:  # every rank ran its share of the forwards (ZeRO-3 gathers are collective)
        torch.distributed.all_reduce(sums)
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, per_batch)
        per_batch = [p for part in gathered for p in part]
    engine.train()
    loss = float(sums[0] / sums[2])
    return {"val_loss": loss, "val_ppl": math.exp(loss), "val_bpb": loss / math.log(2),
            "val_acc": float(sums[1] / sums[2]), "val_batch_losses": [v for _, v in sorted(per_batch)]}
