"""The gather seam of packed ZeRO-3 storage: DeepSpeed's three per-parameter closures, wrapped.

Every gather (fetch, prefetch, ``GatheredParameters``, persistent re-gathers, checkpoint consolidation) goes through
``param.all_gather``, ``param.all_gather_coalesced`` and ``param.partition`` (zero/seams.py lists their signatures).
With ``communication.all_gather: "bf16"`` a packed partition is dequantized just before DeepSpeed's own gather and
the transient dropped after the handle's ``wait()``; with ``"nvfp4"`` the codes and scales are gathered and
dequantized after (same bits, ~3.5x less traffic), and the layer gets the gathered codes (``WeightCodes``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .partition import from_wire

if TYPE_CHECKING:
    from .packed import Entry, PackedPartitions


def install_gather_hooks(store: PackedPartitions) -> None:
    """Wrap the closures of every parameter the storage holds."""
    for e in store.entries.values():
        wrap_closures(store, e.param)


class _ReleaseHandle:
    """Waits on DeepSpeed's handle, then drops the transient BF16 partitions it was gathering from."""

    def __init__(self, handle, release) -> None:
        self.handle, self.release, self.done = handle, release, False

    def wait(self, *args, **kwargs) -> None:
        if self.handle is not None:
            self.handle.wait(*args, **kwargs)
        if not self.done:
            self.release()
            self.done = True


class _MultiHandle:
    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self, *args, **kwargs) -> None:
        for h in self.handles:
            h.wait(*args, **kwargs)


class _PackedGatherHandle:
    """``all_gather: "nvfp4"``: gathers codes and scales of packed partitions, dequantizes on ``wait()``."""

    def __init__(self, store: PackedPartitions, entries: list[Entry]) -> None:
        from deepspeed import comm as dist
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        # Every rank must concatenate the same parameters in the same order (DeepSpeed sorts by ds_id too:
        # callers hand over parameters in a per-rank order).
        entries = sorted(entries, key=lambda e: e.param.ds_id)
        self.store, self.entries, self.status = store, entries, ZeroParamStatus
        group = entries[0].param.ds_process_group
        self.world = dist.get_world_size(group=group)
        parts = []
        for e in entries:
            e.param.ds_status = ZeroParamStatus.INFLIGHT
            parts.append(e.q.wire())
        self.sizes = [t.numel() for t in parts]
        send = torch.cat(parts).to(store.comm_device)
        self.recv = torch.empty(send.numel() * self.world, dtype=torch.uint8, device=store.comm_device)
        dist.all_gather_into_tensor(self.recv, send, group=group)
        store.gathered_bytes += self.recv.numel()
        self.per_rank = send.numel()
        self.done = False

    def wait(self, *args, **kwargs) -> None:
        if self.done:
            return
        chunks = self.recv.view(self.world, self.per_rank)
        off = 0
        for e, size in zip(self.entries, self.sizes):
            p = e.param
            dev = p.ds_tensor.device
            weight, (data, scale, amax) = from_wire(chunks[:, off:off + size].to(dev),
                                                    tuple(e.codes.stored_shape or p.ds_shape),
                                                    self.store.block, e.codes.agreed_amax.to(dev),
                                                    self.store.e4m3_bound)
            off += size
            p.data = weight.to(p.ds_tensor.dtype).view(p.ds_shape).to(p.device)
            # the codes as they arrived: the forward multiplies them instead of quantizing again
            e.codes.offer_gathered(p, (data.to(p.device), scale.to(p.device), amax.to(p.device)))
            p.ds_status = self.status.AVAILABLE
        self.done = True


def wrap_closures(store: PackedPartitions, p) -> None:
    """Replace ``p``'s three gather/release closures (signatures: zero/seams.py) with ones that go through
    ``store``."""
    orig_coalesced, orig_gather, orig_partition = p.all_gather_coalesced, p.all_gather, p.partition

    def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False):
        params = list(params)
        mine = store.needs(params)
        if store.all_gather == "nvfp4" and mine:
            ids = {id(e.param) for e in mine}
            rest = [q for q in params if id(q) not in ids]
            handles = [_PackedGatherHandle(store, mine)]
            if rest:
                handles.insert(0, orig_coalesced(rest, safe_mode=safe_mode, quantize=quantize))
            return _MultiHandle(handles)
        store.materialize(mine)
        return _ReleaseHandle(orig_coalesced(params, safe_mode=safe_mode, quantize=quantize),
                              lambda: store.release(mine))

    def all_gather(param_list=None, async_op: bool = False, hierarchy: int = 0):
        params = [p] if param_list is None else list(param_list)
        mine = store.needs(params)
        if store.all_gather == "nvfp4" and mine and not async_op:
            ids = {id(e.param) for e in mine}
            _PackedGatherHandle(store, mine).wait()
            rest = [q for q in params if id(q) not in ids]
            return orig_gather(rest, async_op=False, hierarchy=hierarchy) if rest else None
        store.materialize(mine)
        ret = orig_gather(params, async_op=async_op, hierarchy=hierarchy)
        if not async_op:
            store.release(mine)
            return ret
        # the transients may be read by any of the handles: drop them once every handle has waited
        pending = {"left": len(ret)}

        def one_done() -> None:
            pending["left"] -= 1
            if pending["left"] == 0:
                store.release(mine)

        if not ret:
            store.release(mine)
        return [_ReleaseHandle(h, one_done) for h in ret]

    def partition(param_list=None, hierarchy: int = 0, has_been_updated: bool = False, free_data: bool = True):
        params = [p] if param_list is None else list(param_list)
        for q in params:  # released: the gathered codes go with the gathered weight
            e = store.entries.get(id(q))
            if e is not None and e.codes is not None:
                e.codes.drop_gathered()
        if not has_been_updated or not store.packed:
            return orig_partition(params, hierarchy=hierarchy, has_been_updated=has_been_updated,
                                  free_data=free_data)
        mine = [store.entries[id(q)] for q in params if id(q) in store.entries and store.entries[id(q)].packable]
        ids = {id(e.param) for e in mine}
        for e in mine:
            store.repack_from_full(e)
        rest = [q for q in params if id(q) not in ids]
        if mine:
            orig_partition([e.param for e in mine], hierarchy=hierarchy, has_been_updated=False,
                           free_data=free_data)
        if rest:
            orig_partition(rest, hierarchy=hierarchy, has_been_updated=True, free_data=free_data)

    p.all_gather_coalesced, p.all_gather, p.partition = all_gather_coalesced, all_gather, partition
