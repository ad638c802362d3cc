"""The gather seam of packed ZeRO-3 storage: DeepSpeed's three per-parameter closures, wrapped around the
storage's wire format (zero/wire.py).

Every gather (fetch, prefetch, ``GatheredParameters``, persistent re-gathers, checkpoint consolidation) goes through
``param.all_gather``, ``param.all_gather_coalesced`` and ``param.partition`` (zero/seams.py lists their signatures).
This file only adapts those hooks: what a partition sends and how gathered bytes become the weight is the wire
format's (``store.wire.pre_all_gather`` / ``post_all_gather``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .packed import Entry, PackedPartitions


def install_gather_hooks(store: PackedPartitions) -> None:
    """Wrap the closures of every ZeRO-3 parameter of the engine's module: DeepSpeed gathers a list of parameters
    through the first one's closure, and a list may mix packed weights with parameters the storage does not hold
    (a frozen base's norms and embeddings), in a per-rank order."""
    for p in {id(p): p for p in store.engine.module.parameters()}.values():  # every entry's parameter is one
        if hasattr(p, "ds_id"):
            wrap_closures(store, p)


class _AfterWait:
    """Waits on DeepSpeed's handle, then runs ``done`` once (the wire format's ``post_all_gather``)."""

    def __init__(self, handle, done) -> None:
        self.handle, self.done, self.ran = handle, done, False

    def wait(self, *args, **kwargs) -> None:
        if self.handle is not None:
            self.handle.wait(*args, **kwargs)
        if not self.ran:
            self.done()
            self.ran = True


class _MultiHandle:
    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self, *args, **kwargs) -> None:
        for h in self.handles:
            h.wait(*args, **kwargs)


class _OwnGather:
    """A wire format that gathers its own bytes: one ``all_gather_into_tensor`` of every parameter's
    ``pre_all_gather`` bytes; ``wait()`` hands each parameter its ``[world, bytes]`` slice."""

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
            parts.append(store.wire.pre_all_gather(store, e).reshape(-1))
        self.sizes = [t.numel() for t in parts]
        send = torch.cat(parts).to(store.comm_device)
        self.recv = torch.empty(send.numel() * self.world, dtype=send.dtype, device=store.comm_device)
        dist.all_gather_into_tensor(self.recv, send, group=group)
        store.gathered_bytes += self.recv.numel() * self.recv.element_size()
        self.per_rank = send.numel()
        self.done = False

    def wait(self, *args, **kwargs) -> None:
        if self.done:
            return
        chunks = self.recv.view(self.world, self.per_rank)
        off = 0
        for e, size in zip(self.entries, self.sizes):
            self.store.wire.post_all_gather(self.store, e, chunks[:, off:off + size])
            off += size
            e.param.ds_status = self.status.AVAILABLE
        self.done = True


def wrap_closures(store: PackedPartitions, p) -> None:
    """Replace ``p``'s three gather/release closures (signatures: zero/seams.py) with ones that go through
    ``store``."""
    orig_coalesced, orig_gather, orig_partition = p.all_gather_coalesced, p.all_gather, p.partition

    def pre(entries: list[Entry]) -> None:  # a DeepSpeed-carried wire format: prepare what DeepSpeed gathers
        for e in entries:
            store.wire.pre_all_gather(store, e)

    def post(entries: list[Entry]) -> None:
        for e in entries:
            store.wire.post_all_gather(store, e, None)

    def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False):
        params = list(params)
        mine = store.needs(params)
        if not store.wire.deepspeed_collective and mine:
            ids = {id(e.param) for e in mine}
            rest = [q for q in params if id(q) not in ids]
            handles = [_OwnGather(store, mine)]
            if rest:
                handles.insert(0, orig_coalesced(rest, safe_mode=safe_mode, quantize=quantize))
            return _MultiHandle(handles)
        pre(mine)
        return _AfterWait(orig_coalesced(params, safe_mode=safe_mode, quantize=quantize), lambda: post(mine))

    def all_gather(param_list=None, async_op: bool = False, hierarchy: int = 0):
        params = [p] if param_list is None else list(param_list)
        mine = store.needs(params)
        if not store.wire.deepspeed_collective and mine and not async_op:
            ids = {id(e.param) for e in mine}
            _OwnGather(store, mine).wait()
            rest = [q for q in params if id(q) not in ids]
            return orig_gather(rest, async_op=False, hierarchy=hierarchy) if rest else None
        pre(mine)
        ret = orig_gather(params, async_op=async_op, hierarchy=hierarchy)
        if not async_op:
            post(mine)
            return ret
        # the transients may be read by any of the handles: drop them once every handle has waited
        pending = {"left": len(ret)}

        def one_done() -> None:
            pending["left"] -= 1
            if pending["left"] == 0:
                post(mine)

        if not ret:
            post(mine)
        return [_AfterWait(h, one_done) for h in ret]

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
