"""The model's repeated transformer blocks, which ``precision.modules`` rules count (first, last, a fraction)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Blocks:
    """Where the blocks are, how many, and the block ordinal (0 .. count-1) of any dotted module name inside one.

    ``where`` is the container's dotted name (``""`` for the root), ``kind`` the blocks' class name.
    """

    where: str
    count: int
    kind: str
    index_of: Callable[[str], int | None]

    def describe(self) -> str:
        return f"{self.where or '<root>'} ({self.count} x {self.kind})"


def _child_index(prefix: str, positions: dict[int, int]) -> Callable[[str], int | None]:
    """Ordinal of ``name`` whose first component below ``prefix`` is a child index listed in ``positions``."""
    lead = f"{prefix}." if prefix else ""

    def index_of(name: str) -> int | None:
        if not name.startswith(lead):
            return None
        head = name[len(lead):].split(".", 1)[0]
        return positions.get(int(head)) if head.isdigit() else None

    return index_of


def find_blocks(model: nn.Module, exclude: set[str] | frozenset[str] = frozenset()) -> Blocks | None:
    """The longest ``nn.ModuleList`` (>= 2) whose children share one type, other than those named in ``exclude``
    (lists of MoE experts, which can be longer than the list of blocks)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, m in model.named_modules():
        same_type = (isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1
                     and name not in exclude)
        if same_type and (best is None or len(m) > len(best[1])):
            best = (name, m)
    if best is None:
        return None
    name, ml = best
    return Blocks(name, len(ml), type(ml[0]).__name__, _child_index(name, {i: i for i in range(len(ml))}))


def blocks_among(kinds: Sequence[str], where: str = "") -> Blocks | None:
    """Blocks of a flat layer list (a pipeline's ``LayerSpec`` list): the most common layer kind (>= 2 of it), its
    layers numbered in order; children of ``where`` are named by their position in the whole list (as
    ``deepspeed.pipe.PipelineModule`` names them, also on stages that hold only some of them)."""
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    if not counts or max(counts.values()) < 2:
        return None
    kind = max(counts, key=lambda k: (counts[k], -kinds.index(k)))
    positions = {i: n for n, i in enumerate(i for i, k in enumerate(kinds) if k == kind)}
    return Blocks(where, len(positions), kind, _child_index(where, positions))
