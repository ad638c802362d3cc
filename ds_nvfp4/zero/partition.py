"""How one rank's ZeRO-3 partition of a weight is stored in NVFP4 (pure tensor math, no DeepSpeed).

ZeRO-3 gives rank r the flat slice ``[r*P, (r+1)*P)`` of the row-major weight ``[N, K]`` (``P = ceil(N*K/ws)``,
padding only at the end). NVFP4 blocks are local: a 1x16 block is 16 consecutive elements of one row, a 16x16
tile spans 16 rows. A partition can be stored packed, *exactly as the whole weight would be*, when it holds whole
blocks and no padding: then its codes and scales equal the corresponding slice of ``quantize(full weight)``
computed with the same (globally agreed) amax, and the gathered dequantized weight is bit-identical to the
dequantization of the full tensor. Otherwise the partition keeps BF16 storage and the reason is reported:
no re-blocking, no double quantization, nothing silent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format import NVFP4Storage, quantize
from ..format.constants import BLOCK_SIZE


@dataclass(frozen=True)
class PartitionLayout:
    """``rows x cols`` view of a rank's flat partition used for quantization, or why there is none."""

    packable: bool
    rows: int = 0
    cols: int = 0
    reason: str = ""


def partition_layout(shape: tuple[int, int], partition_numel: int, world_size: int, block: str) -> PartitionLayout:
    n, k = shape
    p = partition_numel
    if (n * k) % world_size:
        return PartitionLayout(False, reason=f"{n}x{k} = {n * k} elements do not split evenly over {world_size} "
                                             "ranks (ZeRO pads the last partition): stored BF16")
    if block == "1x16":
        if p % BLOCK_SIZE:
            return PartitionLayout(False, reason=f"the {p}-element partition is not a whole number of 1x16 blocks: "
                                                 "stored BF16")
        return PartitionLayout(True, p // BLOCK_SIZE, BLOCK_SIZE)
    if p % (BLOCK_SIZE * k):
        return PartitionLayout(False, reason=f"a partition boundary cuts a 16x16 tile (out_features/world_size = "
                                             f"{n}/{world_size} is not a multiple of 16): stored BF16")
    return PartitionLayout(True, p // k, k)


def pack_partition(flat: torch.Tensor, layout: PartitionLayout, block: str, amax: torch.Tensor) -> NVFP4Storage:
    """Quantize a flat FP32/BF16 partition ``[P]`` with the global ``amax`` (float32 0-dim)."""
    return quantize(flat.reshape(layout.rows, layout.cols), block=block, amax=amax)


def unpack_partition(q: NVFP4Storage, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Flat ``[P]`` dequantized partition."""
    return q.dequantize(dtype).reshape(-1)
