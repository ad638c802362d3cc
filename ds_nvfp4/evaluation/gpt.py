"""The reference GPT of the evaluation runs (nanoGPT-style), its deterministic batches and its held-out evaluation.

Imported by ``launch/train.py`` (which trains it under DeepSpeed), the fine-tunes and the linear probe (which load
its checkpoints). Byte-level (vocabulary 256); pre-LN blocks of causal SDPA attention and a GELU MLP; the LM head
tied to the embedding (ds_nvfp4 keeps it BF16 and says why).

The Mixture-of-Experts variant (``moe-*`` presets) replaces each block's MLP by a top-k routed SwiGLU experts layer
stored as transformers 5 stores its experts (``gate_up_proj [E, 2I, d]``, ``down_proj [E, d, I]``, called with
``(hidden [T, d], top_k_index [T, k], top_k_weights [T, k])``), so ``ds_nvfp4`` converts it exactly as it converts a
Qwen3-MoE or Mixtral experts module, and a ``*Router`` module that stays BF16. Training adds the Switch/Mixtral
load-balancing loss (:attr:`GPT.aux_loss`).
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
# name: (layers, d_model, heads, experts, top-k, expert intermediate size); moe-5m: 5.2M parameters, of which 4.7M
# in experts, ~1.5M active per token (2 of 8 experts)
MOE_PRESETS = {"moe-1m": (4, 64, 2, 4, 2, 128), "moe-5m": (6, 128, 2, 8, 2, 256)}
#: the load-balancing loss coefficient (Switch Transformer, Mixtral: 0.01)
AUX_LOSS_COEF = 0.01


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

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """``x + attention(ln1(x))`` for ``x [B, T, d]`` (shared with :class:`MoEBlock`)."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # attention BMMs stay BF16
        return x + self.proj(a.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TopKRouter(nn.Module):
    """The router of an MoE block: ``weight [E, d]``; kept BF16 by ds_nvfp4 (found by its role: the ``[E, d]`` GEMM
    beside the E experts)."""

    def __init__(self, d: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(experts, d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, d]`` -> (probabilities ``[T, E]`` float32, top-k weights ``[T, k]`` summing to 1, indices
        ``[T, k]``)."""
        probs = F.linear(x, self.weight).float().softmax(-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        return probs, top_w / top_w.sum(-1, keepdim=True), top_i


class Experts(nn.Module):
    """``E`` SwiGLU experts in transformers 5's layout: ``gate_up_proj [E, 2I, d]`` (gate rows, then up rows) and
    ``down_proj [E, d, I]``, both ``[out, in]`` per expert; the eager loop of transformers' experts modules, with the
    attributes transformers' experts interface declares (``use_experts_implementation``), so ds_nvfp4 runs it as it
    runs a Qwen3-MoE or Mixtral experts module (grouped FP4 GEMMs)."""

    has_gate, has_bias, is_transposed, is_concatenated, has_post_expert_norm = True, False, False, True, False
    #: this forward computes what transformers' experts interface computes (nn/moe.py)
    ds_nvfp4_experts_interface = True

    def __init__(self, experts: int, d: int, inter: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, d))
        self.down_proj = nn.Parameter(torch.empty(experts, d, inter))
        self.act_fn = nn.SiLU()

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden [T, d]`` -> ``[T, d]``: each token's experts' outputs weighted by the router."""
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out


class MoE(nn.Module):
    """Top-k routed experts in place of the MLP; keeps its load-balancing loss of the last forward in ``aux_loss``."""

    def __init__(self, d: int, experts: int, top_k: int, inter: int) -> None:
        super().__init__()
        self.router = TopKRouter(d, experts, top_k)
        self.experts = Experts(experts, d, inter)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        probs, top_w, top_i = self.router(flat)
        # Switch Transformer / Mixtral: E * sum_e (share of the T*k assignments to e) * (mean router probability of e);
        # 1.0 when routing is uniform, up to E when one expert takes every token
        n = probs.shape[-1]
        share = F.one_hot(top_i, n).float().mean(dim=(0, 1))
        self.aux_loss = n * (share * probs.mean(0)).sum()
        return self.experts(flat, top_i, top_w.to(flat.dtype)).view(b, t, d)


class MoEBlock(nn.Module):
    """Pre-LN transformer block: causal SDPA attention + routed experts."""

    def __init__(self, d: int, heads: int, experts: int, top_k: int, inter: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.moe = MoE(d, experts, top_k, inter)

    attend = Block.attend  # the same attention (the same parameter names: ln1, qkv, proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.moe(self.ln2(x))


def model_spec(name: str) -> dict:
    """The architecture of a preset as written to a run's config.json (``model``) and read by :meth:`GPT.from_spec`."""
    if name in MOE_PRESETS:
        layers, d, heads, experts, top_k, inter = MOE_PRESETS[name]
        return {"layers": layers, "d_model": d, "heads": heads, "experts": experts, "top_k": top_k,
                "expert_intermediate": inter}
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(PRESETS) + sorted(MOE_PRESETS)}")
    layers, d, heads = PRESETS[name]
    return {"layers": layers, "d_model": d, "heads": heads}


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, seq: int, vocab: int = 256, *, experts: int = 0,
                 top_k: int = 2, expert_intermediate: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(MoEBlock(d, heads, experts, top_k, expert_intermediate) if experts else
                                    Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: ds_nvfp4 keeps it BF16 and says so
        self.apply(self._init)

    @classmethod
    def from_spec(cls, spec: dict, seq: int) -> GPT:
        """The model of a run's config.json ``model`` entry (:func:`model_spec`; ``params`` is ignored)."""
        return cls(spec["layers"], spec["d_model"], spec["heads"], seq, experts=spec.get("experts", 0),
                   top_k=spec.get("top_k", 2), expert_intermediate=spec.get("expert_intermediate", 0))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding, TopKRouter)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, Experts):
            nn.init.normal_(m.gate_up_proj, std=0.02)
            nn.init.normal_(m.down_proj, std=0.02)

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """The mean load-balancing loss of the MoE blocks in the last forward (a scalar), None for a dense model."""
        losses = [b.moe.aux_loss for b in self.blocks if isinstance(b, MoEBlock) and b.moe.aux_loss is not None]
        return torch.stack(losses).mean() if losses else None

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
