"""How one rank's ZeRO-3 partition of a weight is stored in NVFP4 (pure tensor math, no DeepSpeed).

ZeRO-3 gives rank r the flat slice ``[r*P, (r+1)*P)`` of the row-major weight (``P = ceil(numel/ws)``, padding
only at the end): ``[N, K]`` for a Linear, ``[K, N]`` for a Conv1D (its stored layout), ``[E, N, K]`` for MoE
experts (one matrix per expert, each with its own per-tensor amax). NVFP4 blocks are local: a 1x16 block is 16
consecutive elements of one row, a 16x16 tile spans 16 rows of one matrix. A partition can be stored packed,
*exactly as the whole weight would be*, when it holds whole blocks and no padding: then its codes and scales equal
the corresponding slice of ``quantize(whole matrix)`` computed with the same (globally agreed) amax, and the gathered
dequantized weight is bit-identical to the dequantization of the full tensor. A partition of an experts weight may
hold rows of several experts: it is stored as one *segment* per expert, each quantized with that expert's amax.
Otherwise the partition keeps BF16 storage and the reason is reported: no re-blocking, no double quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format import NVFP4Storage, quantize
from ..format.constants import BLOCK_SIZE, E4M3_MAX


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + rows*cols)`` of a partition, one expert's (``expert`` None: a 2-D weight), viewed
    as ``rows x cols`` for quantization."""

    start: int
    rows: int
    cols: int
    expert: int | None = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class PartitionLayout:
    """The segments of a rank's flat partition, or why it cannot be stored packed."""

    packable: bool
    segments: tuple[Segment, ...] = ()
    experts: int | None = None
    reason: str = ""


def partition_layout(shape: tuple[int, ...], partition_numel: int, world_size: int, block: str,
                     rank: int = 0) -> PartitionLayout:
    """The layout of rank ``rank``'s partition of a weight of ``shape`` (2-D, or 3-D ``[E, rows, cols]``)."""
    experts = shape[0] if len(shape) == 3 else None
    rows, cols = shape[-2:]
    matrix = rows * cols
    total = matrix * (experts or 1)
    p = partition_numel
    what = "x".join(map(str, shape))
    if total % world_size:
        return PartitionLayout(False, reason=f"{what} = {total} elements do not split evenly over {world_size} ranks "
                                             "(ZeRO pads the last partition): stored BF16")
    if block == "1x16":
        if p % BLOCK_SIZE or cols % BLOCK_SIZE:
            return PartitionLayout(False, reason=f"the {p}-element partition is not a whole number of 1x16 blocks: "
                                                 "stored BF16")
        unit = BLOCK_SIZE  # a segment is viewed as [numel/16, 16]: blocks are 16 consecutive elements of a row
    else:
        if p % (BLOCK_SIZE * cols) or rows % BLOCK_SIZE:
            per = f"{rows}/{world_size}" if experts is None else f"{rows} rows per expert, {p // cols} per rank"
            return PartitionLayout(False, reason=f"a partition boundary cuts a 16x16 tile ({per}: not multiples of "
                                                 "16): stored BF16")
        unit = cols  # whole rows of 16x16 tiles
    segments, start = [], rank * p
    while start < (rank + 1) * p:  # split at matrix (expert) boundaries, which are block boundaries too
        end = min((rank + 1) * p, (start // matrix + 1) * matrix)
        n = end - start
        segments.append(Segment(start - rank * p, n // unit, unit, start // matrix if experts else None))
        start = end
    return PartitionLayout(True, tuple(segments), experts)


@dataclass
class PackedPartition:
    """A rank's partition stored NVFP4: one :class:`NVFP4Storage` per segment (its own amax)."""

    parts: tuple[NVFP4Storage, ...]

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.parts)

    def wire(self) -> torch.Tensor:
        """uint8 ``[P/2 + scales]``: every segment's codes, then every segment's scales (what NVFP4 gathers send;
        the same length on every rank)."""
        return torch.cat([q.data.reshape(-1) for q in self.parts]
                         + [q.scale.view(torch.uint8).reshape(-1) for q in self.parts])

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Flat ``[P]`` dequantized partition."""
        return torch.cat([q.dequantize(dtype).reshape(-1) for q in self.parts])

    def to(self, device) -> PackedPartition:
        return PackedPartition(tuple(q.to(device) for q in self.parts))


def local_amax(flat: torch.Tensor, layout: PartitionLayout) -> torch.Tensor:
    """float32 max |x| of this partition: 0-dim for a 2-D weight, ``[E]`` per expert (0 where it holds none)."""
    if layout.experts is None:
        return flat.detach().abs().amax().float()
    out = torch.zeros(layout.experts, dtype=torch.float32, device=flat.device)
    for s in layout.segments:
        out[s.expert] = flat.narrow(0, s.start, s.numel).detach().abs().amax().float()
    return out


def pack_partition(flat: torch.Tensor, layout: PartitionLayout, block: str, amax: torch.Tensor,
                   **scaling) -> PackedPartition:
    """Quantize a flat FP32/BF16 partition ``[P]`` with the agreed ``amax`` (0-dim, or ``[E]`` per expert);
    ``scaling``: ``ds_nvfp4.quantize``'s ``scaling``/``e4m3_bound``/``error`` (4/6 decides per block or tile, which
    a partition holds whole, so it too gives the slice of the whole matrix's codes)."""
    return PackedPartition(tuple(
        quantize(flat.narrow(0, s.start, s.numel).reshape(s.rows, s.cols), block=block,
                 amax=(amax if s.expert is None else amax[s.expert]).reshape(()).clone(), **scaling)
        for s in layout.segments))


def partition_from_codes(codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         layout: PartitionLayout) -> PackedPartition:
    """A partition in 1x16 blocks from codes stored elsewhere (a published checkpoint), taken as they are: ``codes``
    = ``(data uint8 [P/2], scale float8_e4m3fn [P/16], amax float32)`` of the partition's flat element range, the
    amax 0-dim for a 2-D weight and ``[E]`` (every expert's) for an experts weight. The result is what
    :func:`pack_partition` would give for values whose quantization these codes are (one segment of rows of 16 per
    expert the partition touches), so gathers and the forward treat it like any packed partition."""
    data, scale, amax = codes
    if any(s.cols != BLOCK_SIZE for s in layout.segments) or not layout.packable:
        raise ValueError("stored codes can only be taken for a packable partition in 1x16 blocks (rows of 16)")
    numel = sum(s.numel for s in layout.segments)
    if data.numel() * 2 != numel or scale.numel() * BLOCK_SIZE != numel:
        raise ValueError(f"stored codes for {numel} elements: got {data.numel()} code bytes and {scale.numel()} "
                         f"scales, expected {numel // 2} and {numel // BLOCK_SIZE}")
    if tuple(amax.shape) != (() if layout.experts is None else (layout.experts,)):
        raise ValueError(f"stored codes' amax has shape {list(amax.shape)}, the weight "
                         f"{'one per tensor' if layout.experts is None else f'one per expert ({layout.experts})'}")
    data, scale = data.reshape(-1), scale.reshape(-1)
    return PackedPartition(tuple(
        NVFP4Storage(data.narrow(0, s.start // 2, s.numel // 2).reshape(s.rows, BLOCK_SIZE // 2).contiguous(),
                     scale.narrow(0, s.start // BLOCK_SIZE, s.rows).reshape(s.rows, 1).contiguous(),
                     (amax if s.expert is None else amax[s.expert]).float().reshape(()).clone(),
                     torch.Size((s.rows, BLOCK_SIZE)), "1x16", E4M3_MAX)
        for s in layout.segments))


def unpack_partition(q: PackedPartition, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Flat ``[P]`` dequantized partition."""
    return q.dequantize(dtype)


def from_wire(chunks: torch.Tensor, shape: tuple[int, ...], block: str, amax: torch.Tensor,
              e4m3_bound: float = E4M3_MAX) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The whole weight from every rank's :meth:`PackedPartition.wire` (``chunks`` ``[world, bytes]``, rank order):
    ``(float32 weight in shape, codes (data, scale e4m3, amax) in the weight's layout, [E, ...] for experts)``;
    ``e4m3_bound``: the global E4M3 bound the partitions were quantized with (256 or 448 with 4/6)."""
    rows, cols = shape[-2:]
    lead = shape[:-2]
    total = rows * cols * (shape[0] if lead else 1)
    data_bytes = total // 2 // chunks.shape[0]
    data = chunks[:, :data_bytes].reshape(*lead, rows, cols // 2)
    scale_rows = rows // BLOCK_SIZE if block == "16x16" else rows
    scale = chunks[:, data_bytes:].contiguous().view(torch.float8_e4m3fn).reshape(*lead, scale_rows, cols // 16)
    if not lead:
        weight = NVFP4Storage(data, scale, amax, torch.Size((rows, cols)), block, e4m3_bound).dequantize(torch.float32)
    else:
        weight = torch.stack([NVFP4Storage(data[e], scale[e], amax[e], torch.Size((rows, cols)), block, e4m3_bound)
                              .dequantize(torch.float32) for e in range(shape[0])])
    return weight, (data, scale, amax)
