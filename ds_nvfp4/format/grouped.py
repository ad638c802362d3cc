"""Grouped quantization: many tensors stacked along rows, each group of rows with its own per-tensor amax.

An MoE layer multiplies each expert's weight ``[N, K]`` by the tokens routed to it. NVFP4 gives every one of
those tensors its own per-tensor amax (an expert's weight; an expert's slice of the input), so quantizing them one
call per expert costs a host loop. Here the groups are stacked along rows (``[M, K]``, rows sorted by group) and
quantized in one pass: the block scales of a row use its group's amax, with exactly the float32 operations of
:func:`ds_nvfp4.quantize` (``_kernels.scales``), so every group's codes, scales and values are bit for bit those of
quantizing that group alone (tests/format/test_grouped.py). No host synchronisation: group membership is a tensor.
"""

from __future__ import annotations

import torch

from . import _kernels
from ._compile import compiled
from .constants import BLOCK_SIZE, E4M3_MAX, FLT_MAX, GLOBAL_SCALE_NUMERATOR

_F32 = torch.float32


def group_amax(bamax: torch.Tensor, row_group: torch.Tensor, groups: int) -> torch.Tensor:
    """float32 ``[groups]``: the max of the block amaxes ``bamax [R, nb]`` over the rows of each group
    (``row_group [R]`` int64 in ``[0, groups)``); 0 for a group without rows, NaN when a row of it held NaN."""
    row_max = bamax.amax(dim=1)
    out = torch.zeros(groups, dtype=_F32, device=bamax.device)
    out = out.scatter_reduce(0, row_group, row_max, reduce="amax", include_self=False)
    # scatter_reduce's amax may drop NaN: poison the groups whose rows held one, as quantize() does
    bad = torch.zeros(groups, dtype=torch.bool, device=bamax.device).index_put((row_group,), row_max.isnan(),
                                                                                 accumulate=True)
    return torch.where(bad, torch.full_like(out, float("nan")), out)


def scales_grouped(bamax: torch.Tensor, row_group: torch.Tensor, local: torch.Tensor,
                   amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_kernels.scales` per group: ``(used amax [G], e4m3 scales like bamax, float32 enc like bamax)``.

    ``local``: each group's own amax (:func:`group_amax`); ``amax``: ``[G]`` amaxes to use instead (ZeRO-agreed),
    or None. Element for element the same float32 operations as the per-tensor kernel.
    """
    used = local if amax is None else amax.to(_F32).reshape(-1)
    finite = torch.isfinite(local) & torch.isfinite(used)
    used = torch.where(finite, used, torch.full_like(used, float("nan")))
    one = torch.tensor(1.0, dtype=_F32, device=bamax.device)
    s_enc = torch.tensor(GLOBAL_SCALE_NUMERATOR, dtype=_F32, device=bamax.device) / used
    s_enc = torch.where((used == 0) | (s_enc == 0), one, s_enc)
    s_enc = torch.clamp(s_enc, max=FLT_MAX)
    s_dec = one / s_enc
    rows_enc, rows_dec = s_enc[row_group].unsqueeze(1), s_dec[row_group].unsqueeze(1)
    sixth = torch.tensor(1.0 / 6.0, dtype=_F32, device=bamax.device)
    scale = torch.clamp(bamax * (rows_enc * sixth), max=E4M3_MAX).to(torch.float8_e4m3fn)
    enc = torch.clamp(one / (scale.to(_F32) * rows_dec), max=FLT_MAX)
    return used, scale, enc


def quantize_grouped(x: torch.Tensor, row_group: torch.Tensor, groups: int, *, block: str = "1x16",
                     amax: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                     keep_codes: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                         torch.Tensor]:
    """Quantize the groups of rows of ``x`` ``[M, K]`` (nearest-even, standard NVFP4) straight to GEMM operands.

    Args:
        x: float32 or bfloat16 ``[M, K]``, ``K % 16 == 0``; rows of one group need not be contiguous.
        row_group: int64 ``[M]``, each row's group in ``[0, groups)``. With ``block="16x16"`` the 16 rows of a tile
            must share a group (``M % 16 == 0``; an expert weight ``[E*N, K]`` with ``N % 16 == 0``).
        amax: float32 ``[groups]`` per-tensor amaxes to use instead of each group's own (>= its max |x|).
        dtype: the operand values' dtype (float32 or bfloat16; exact in both).
        keep_codes: also return the packed codes ``[M, K/2]``.
    Returns:
        ``(values [M, K] dtype, amax [groups] float32 (NaN for a group that held NaN/Inf), codes or None,
        scale e4m3 [M, K/16] or [M/16, K/16])``: per group, bit for bit
        ``quantize_values(x[rows of g], amax=amax[g])``.
    """
    if x.dim() != 2 or x.shape[1] % BLOCK_SIZE:
        raise ValueError(f"quantize_grouped takes [M, K] with K a multiple of {BLOCK_SIZE}, got {tuple(x.shape)}")
    if block == "16x16" and x.shape[0] % BLOCK_SIZE:
        raise ValueError(f"block='16x16' needs M a multiple of {BLOCK_SIZE}, got {tuple(x.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    tile_group = row_group if block == "1x16" else row_group[::BLOCK_SIZE].contiguous()
    values, codes, scale, used = _quantize_operand_grouped(x, tile_group, groups, amax, block, dtype, keep_codes)
    return values, used, (codes if keep_codes else None), scale


def _quantize_grouped_cpp(x, tile_group, groups, amax, block, dtype, want_codes):
    """The C++ twin (``csrc/nvfp4_cpu.cpp``: one call), or None where it does not apply."""
    ext = _kernels._cpu_ext_for(x, dtype)
    if ext is None:
        return None
    return tuple(ext.quantize_operand_grouped(x, tile_group, groups, amax, 1 if block == "1x16" else BLOCK_SIZE,
                                              dtype == torch.bfloat16, want_codes))


@compiled(native=_quantize_grouped_cpp)
def _quantize_operand_grouped(x: torch.Tensor, tile_group: torch.Tensor, groups: int, amax: torch.Tensor | None,
                              block: str, dtype: torch.dtype, want_codes: bool):
    """The definition: ``(values, codes or empty, scale, used amax [groups])`` (block amaxes, the groups' scales,
    codes and values in the float32 order of ``_kernels``)."""
    bamax = _kernels.block_amax(x, block)
    local = group_amax(bamax, tile_group, groups)
    used, scale, enc = scales_grouped(bamax, tile_group, local, amax)
    values, codes = _kernels.encode_values(x, enc, scale, block, dtype, want_codes)
    return values, codes, scale, used


def group_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 ``[rows]``: the group of each row of a matrix whose groups end at ``offsets`` (int ``[G]``, cumulative,
    rows sorted by group); rows at or past ``offsets[-1]`` get group ``G - 1`` (callers mask them). No host sync."""
    idx = torch.arange(rows, device=offsets.device)
    return torch.searchsorted(offsets.to(torch.int64), idx, right=True).clamp_(max=offsets.numel() - 1)
