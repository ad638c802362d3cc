"""4/6 block scaling (arXiv 2512.02010; Transformer Engine's ``nvfp4_4over6``): each block is scaled so that its
largest magnitude maps to 6 (standard NVFP4) or to 4, whichever reconstructs the block with less error.

Why: E2M1's grid is coarsest at the top (4 -> 6 is one step), so a block's near-maximal values carry most of its
error; mapping the block maximum to 4 instead uses the finer steps below 4 at the cost of never using 6. The
decision is per block (per 16x16 tile for ``block="16x16"``), the codes and E4M3 scales stay standard NVFP4, so
every NVFP4 decoder reads the result (only the encoder changes).

The definition followed bit for bit is TE's reference (``transformer_engine/pytorch/custom_recipes/
reference_nvfp4.py``, ``_quantize_blockwise_4over6_reference``, TE 2.17+), all float32, in this order:

    S_enc  = 6 * bound / amax          bound: the global E4M3 bound, 256 by default with 4/6 (TE
                                       ``nvfp4_4over6_e4m3_use_256``), 448 as standard NVFP4
    S_dec  = 1 / S_enc
    base   = (block_amax / 6) * S_enc
    s4, s6 = e4m3(clamp(1.5 * base, 448)), e4m3(clamp(base, 448))       map-to-4 uses a 1.5x larger scale
    enc_c  = min(1 / (s_c * S_dec), FLT_MAX);  q_c = e2m1_rne(x * enc_c)
    err_c  = sum over the block's 16 elements, in index order, of |((e2m1(q_c) * s_c) * amax) / (6 * bound) - x|
             (squared instead of |.| with ``error="MSE"``); 16x16 tiles add their 16 row errors pairwise
             (rows 0-7 + 8-15, then 0-3 + 4-7, ...), as the CUDA warp reduction does
    pick   = map-to-4 where err_4 < err_6 (ties keep map-to-6)

Why the 256 bound: with 448, the block holding the tensor's amax would need the scale 1.5 * 448 = 672 to map to 4,
which E4M3 clamps (and the block then clips); 256 * 1.5 = 384 fits. The decode factor is then
``s_b * amax / (6 * bound)``, carried by :attr:`NVFP4Storage.e4m3_bound`.
"""

from __future__ import annotations

import torch

from . import e2m1
from .constants import BLOCK_SIZE, E2M1_MAX, E4M3_MAX, FLT_MAX

#: the block scalings :func:`ds_nvfp4.quantize` offers: ``"6"`` (standard NVFP4) or ``"4over6"``
SCALINGS = ("6", "4over6")
#: the error metrics of the map-to-4 / map-to-6 choice (TE ``nvfp4_4over6_err_mode``; TE's default "MAE")
ERROR_METRICS = ("MAE", "MSE")
#: the global E4M3 bounds TE allows (``nvfp4_e4m3_max``); 4/6 defaults to 256
E4M3_BOUNDS = (448, 256)
DEFAULT_4OVER6_BOUND = 256

_F32 = torch.float32


def _c(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=_F32, device=like.device)


def _row_errors(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, bound: float,
                metric: str, block: str) -> torch.Tensor:
    """float32 per-row-of-block error, summed over the block's 16 elements in index order: ``[M, nb]``."""
    m, k = x.shape
    nb = k // BLOCK_SIZE
    xs = x.to(_F32).view(m, nb, BLOCK_SIZE)
    vals = e2m1.decode(codes).view(m, nb, BLOCK_SIZE)
    s = scale.to(_F32)
    s = s if block == "1x16" else s.repeat_interleave(BLOCK_SIZE, dim=0)  # [M, nb]
    denom = _c(E2M1_MAX * bound, x)
    err = torch.zeros(m, nb, dtype=_F32, device=x.device)
    for i in range(BLOCK_SIZE):  # TE's order: one element after the other, not a tree
        diff = ((vals[:, :, i] * s) * amax) / denom - xs[:, :, i]
        err = err + (diff * diff if metric == "MSE" else diff.abs())
    return err


def _tile_sum(err: torch.Tensor) -> torch.Tensor:
    """``[M, nb]`` row errors -> ``[M/16, nb]`` tile errors, in the CUDA warp reduction's pairwise order."""
    rows = err.view(err.shape[0] // BLOCK_SIZE, BLOCK_SIZE, err.shape[1])
    for half in (8, 4, 2, 1):
        rows = rows[:, :half] + rows[:, half:2 * half]
    return rows[:, 0]


def quantize_2d(x: torch.Tensor, bamax: torch.Tensor, amax: torch.Tensor | None, block: str, bound: float,
                metric: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4/6 quantization of a contiguous 2-D ``x [M, K]`` (float32 or bfloat16) with its block amaxes.

    Returns:
        ``(amax, scale, data)``: the float32 0-dim amax used (NaN when ``x`` or ``amax`` is not finite: the poison
        flag, as for standard NVFP4), float8_e4m3fn block scales (``bamax``'s shape: ``[M, K/16]`` or
        ``[M/16, K/16]``) and packed uint8 codes ``[M, K/2]``.
    """
    m, k = x.shape
    local = bamax.amax()
    used = local if amax is None else amax.to(_F32).reshape(())
    used = torch.where(torch.isfinite(local) & torch.isfinite(used), used, _c(float("nan"), bamax))
    s_enc = _c(E2M1_MAX * bound, bamax) / used
    s_enc = torch.where((used == 0) | (s_enc == 0), _c(1.0, bamax), s_enc)
    s_enc = torch.clamp(s_enc, max=FLT_MAX)
    s_dec = _c(1.0, bamax) / s_enc
    base = (bamax / _c(E2M1_MAX, bamax)) * s_enc
    candidates = []
    for factor in (1.5, 1.0):  # map-to-4, map-to-6
        scale = torch.clamp(base * _c(factor, bamax), min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
        enc = torch.clamp(_c(1.0, bamax) / (scale.to(_F32) * s_dec), max=FLT_MAX)
        enc_rows = enc if block == "1x16" else enc.repeat_interleave(BLOCK_SIZE, dim=0)
        y = x.to(_F32).view(m, k // BLOCK_SIZE, BLOCK_SIZE) * enc_rows.unsqueeze(-1)
        codes = e2m1.encode_rne(torch.clamp(y, -E2M1_MAX, E2M1_MAX)).view(m, k)
        err = _row_errors(x, codes, scale, used, bound, metric, block)
        candidates.append((scale, codes, err if block == "1x16" else _tile_sum(err)))
    (s4, c4, e4), (s6, c6, e6) = candidates
    pick4 = e4 < e6  # ties keep map-to-6
    pick_rows = pick4 if block == "1x16" else pick4.repeat_interleave(BLOCK_SIZE, dim=0)
    codes = torch.where(pick_rows.repeat_interleave(BLOCK_SIZE, dim=1), c4, c6)
    scale = torch.where(pick4, s4.view(torch.uint8), s6.view(torch.uint8)).view(torch.float8_e4m3fn)
    return used, scale, e2m1.pack(codes)
