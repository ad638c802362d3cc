"""The 16-point Random Hadamard Transform (RHT) of TE's NVFP4 recipe.

``H = diag(s) @ H16 / 4`` with TE's fixed sign vector ``s`` (constants.RHT_SIGNS), held in bfloat16; applied
to consecutive 16-element tiles of the last dimension as ``y = x @ H``. H is orthonormal, so the inverse
is ``y @ H.T``. Inputs are rounded to bfloat16 first and outputs rounded to bfloat16, as TE does; the
16-term dot products are accumulated in float32 (products of bf16 values with +-1/4 are exact).
"""

from __future__ import annotations

import functools

import torch

from .constants import BLOCK_SIZE, RHT_SIGNS


@functools.cache
def _sylvester(n: int) -> tuple[tuple[int, ...], ...]:
    h = [[1]]
    while len(h) < n:
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    return tuple(tuple(r) for r in h)


def rht_matrix(device: torch.device | str | None = None) -> torch.Tensor:
    """bfloat16 [16, 16] matrix ``diag(s) @ H16 / 4``."""
    h = torch.tensor(_sylvester(BLOCK_SIZE), dtype=torch.float32, device=device)
    s = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device)
    return (torch.diag(s) @ h * 0.25).to(torch.bfloat16)


def _apply(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"hadamard: tensor of shape {tuple(x.shape)}: the last dimension must be a "
                         f"multiple of {BLOCK_SIZE}")
    tiles = x.to(torch.bfloat16).reshape(-1, BLOCK_SIZE).to(torch.float32)
    return (tiles @ m.to(torch.float32)).to(torch.bfloat16).reshape(x.shape)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Apply the RHT along the last dimension (``[..., K]``, ``K % 16 == 0``); bfloat16 out."""
    return _apply(x, rht_matrix(x.device))


def inverse_hadamard(y: torch.Tensor) -> torch.Tensor:
    """Undo :func:`hadamard` up to bfloat16 rounding; bfloat16 out."""
    return _apply(y, rht_matrix(y.device).t())
