"""The gather wire formats of packed ZeRO-3 storage: what a rank's partition sends, and how the gathered bytes become
the full weight (``communication.all_gather``).

Each format is one :class:`WireFormat` subclass with the pair of methods Transformer Engine keeps on its NVFP4 tensor
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``); ``zero/gather.py`` is only the adapter that calls them from
DeepSpeed's per-parameter gather closures. Two kinds exist:

- ``deepspeed_collective = True`` (``bf16``): :meth:`~WireFormat.pre_all_gather` puts a transient BF16 partition
  where DeepSpeed expects one and DeepSpeed's own gather runs on it; :meth:`~WireFormat.post_all_gather` drops the
  transient once the gather's handle has waited.
- ``deepspeed_collective = False`` (``nvfp4``): the adapter concatenates every parameter's
  :meth:`~WireFormat.pre_all_gather` bytes (same length on every rank), gathers them with one
  ``all_gather_into_tensor`` and hands each parameter its ``[world, bytes]`` slice in
  :meth:`~WireFormat.post_all_gather`, which sets the full weight.

A new format (say rowwise-only codes with the columnwise copy rebuilt locally) is one class here or in its own file
imported by ``zero/__init__.py``, registered with :func:`register`, plus its name in the schema's
``communication.all_gather`` Literal (tests/zero/test_wire.py checks the two agree). docs/architecture.md shows one.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from .partition import from_wire, unpack_partition

if TYPE_CHECKING:
    from .packed import Entry, PackedPartitions


class WireFormat(ABC):
    """How a packed partition travels in a ZeRO-3 all-gather. Stateless: one instance per storage."""

    #: the ``communication.all_gather`` value that selects it
    name: ClassVar[str]
    #: True: DeepSpeed's own BF16 gather carries the partition (pre/post prepare and drop a transient); False: the
    #: adapter gathers :meth:`pre_all_gather`'s bytes itself
    deepspeed_collective: ClassVar[bool]

    @abstractmethod
    def pre_all_gather(self, store: PackedPartitions, e: Entry) -> torch.Tensor:
        """What ``e``'s partition sends: a flat tensor, the same length on every rank of its group."""

    @abstractmethod
    def post_all_gather(self, store: PackedPartitions, e: Entry, gathered: torch.Tensor | None) -> None:
        """After the gather: make ``e.param`` the full weight from ``gathered`` (``[world, bytes]`` in rank order;
        None when DeepSpeed gathered), or drop what :meth:`pre_all_gather` left behind."""


_FORMATS: dict[str, type[WireFormat]] = {}


def register(cls: type[WireFormat]) -> type[WireFormat]:
    """Class decorator: make ``cls`` selectable as ``communication.all_gather: cls.name``."""
    if cls.name in _FORMATS and _FORMATS[cls.name] is not cls:
        raise ValueError(f"gather wire format {cls.name!r} is registered twice ({_FORMATS[cls.name].__qualname__} "
                         f"and {cls.__qualname__})")
    _FORMATS[cls.name] = cls
    return cls


def names() -> tuple[str, ...]:
    """The registered ``communication.all_gather`` values."""
    return tuple(_FORMATS)


def wire_format(name: str) -> WireFormat:
    """The format ``communication.all_gather: name`` selects."""
    try:
        return _FORMATS[name]()
    except KeyError:
        raise ValueError(f"communication.all_gather {name!r} is not a gather wire format: allowed "
                         f"{', '.join(map(repr, _FORMATS))}") from None


@register
class BF16Wire(WireFormat):
    """Dequantize the packed partition to a transient BF16 one, let DeepSpeed gather it, drop it after the wait
    (the forward quantizes the gathered weight again: same codes, since the amax was agreed)."""

    name = "bf16"
    deepspeed_collective = True

    def pre_all_gather(self, store: PackedPartitions, e: Entry) -> torch.Tensor:
        t0 = time.perf_counter()
        ds = e.param.ds_tensor
        ds.data = unpack_partition(e.q, ds.dtype)
        store.gathered_bytes += e.numel * ds.element_size() * store.world_size(e)
        store.seconds["dequantize_for_gather"] += time.perf_counter() - t0
        return ds

    def post_all_gather(self, store: PackedPartitions, e: Entry, gathered: torch.Tensor | None) -> None:
        ds = e.param.ds_tensor
        ds.data = torch.empty(0, dtype=ds.dtype, device=ds.device)


@register
class NVFP4Wire(WireFormat):
    """Send the partition's codes and E4M3 scales (:meth:`PackedPartition.wire`, ~3.5x fewer bytes than BF16),
    dequantize after the gather (the same bits as the BF16 wire) and hand the layer the gathered codes, so the forward
    multiplies them instead of quantizing again."""

    name = "nvfp4"
    deepspeed_collective = False

    def pre_all_gather(self, store: PackedPartitions, e: Entry) -> torch.Tensor:
        return e.q.wire()

    def post_all_gather(self, store: PackedPartitions, e: Entry, gathered: torch.Tensor | None) -> None:
        assert gathered is not None, "the nvfp4 wire gathers its own bytes"
        p = e.param
        dev = p.ds_tensor.device
        weight, (data, scale, amax) = from_wire(gathered.to(dev), tuple(e.codes.stored_shape or p.ds_shape),
                                                store.block, e.codes.agreed_amax.to(dev), store.e4m3_bound)
        p.data = weight.to(p.ds_tensor.dtype).view(p.ds_shape).to(p.device)
        e.codes.offer_gathered(p, (data.to(p.device), scale.to(p.device), amax.to(p.device)))
