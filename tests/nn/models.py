"""Small models shared by the nn tests."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    def __init__(self, d: int = 32, vocab: int = 64, layers: int = 4, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight
        self.odd = nn.Linear(d, 10)  # out_features not a multiple of 16

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(h)
