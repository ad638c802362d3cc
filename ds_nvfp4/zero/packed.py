"""Packed NVFP4 storage of ZeRO-3 weight partitions: the partitions, their packing, their report.

After ``deepspeed.initialize`` every converted, trainable, block-aligned weight partition is re-packed from the
FP32 master partition: E2M1 codes + E4M3 scales + the FP32 amax agreed across the partition group (one
``all_reduce(MAX)`` per optimizer sub-group). The ``ds_tensor`` object is kept but its ``.data`` becomes an empty
BF16 tensor, so a DeepSpeed path ds_nvfp4 does not know fails loudly instead of gathering garbage. BF16 partitions
of everything else move to one compact buffer per sub-group; DeepSpeed's flat BF16 buffer is released.
The gathers are wrapped in zero/gather.py, the optimizer in zero/optimizer.py; every DeepSpeed name used is
declared in zero/seams.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..nn.fused import share_amax
from ..nn.nonfinite import NonFiniteError
from ..nn.recipe import Recipe
from ..nn.weights import Codes, WeightCodes
from .collectives import agree_max
from .partition import (
    PackedPartition,
    PartitionLayout,
    local_amax,
    pack_partition,
    partition_from_codes,
    partition_layout,
    unpack_partition,
)
from .report import StorageReport
from .wire import WireFormat, wire_format

log = logging.getLogger("ds_nvfp4")

#: where a frozen weight's codes come from instead of its BF16 partition (a published checkpoint): flat element range
#: ``[start, stop)`` of the row-major ``[N, K]`` (experts ``[E, N, K]``) weight -> ``(data uint8 [(stop-start)/2],
#: scale float8_e4m3fn [(stop-start)/16], amax float32 0-dim, or [E] every expert's)``, exactly as stored in 1x16
#: blocks
FrozenSource = Callable[[int, int], Codes]


@dataclass
class Entry:
    """One parameter of one optimizer sub-group, with where its partition sits in the sub-group's flat."""

    param: torch.nn.Parameter
    name: str
    sub_group: int
    offset: int
    numel: int
    layout: PartitionLayout | None = None   # None: not a converted weight
    q: PackedPartition | None = None        # the packed partition when packable
    codes: WeightCodes | None = None        # the owning layer's weight-codes contract (converted weights)
    frozen: bool = False                    # requires_grad False: packed once, no master, never re-quantized

    @property
    def packable(self) -> bool:
        return self.layout is not None and self.layout.packable


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


class PackedPartitions:
    """The packed ZeRO-3 weight partitions of one engine, and DeepSpeed's BF16 ones of everything else.

    Created by :func:`ds_nvfp4.zero.install` (``ds_nvfp4.initialize``). ``converted`` maps the ``id`` of every
    converted weight to its layer's :class:`~ds_nvfp4.nn.WeightCodes`, through which the storage tells the layer the
    agreed amax and hands it gathered codes.
    """

    def __init__(self, engine, names: dict[int, str], converted: dict[int, WeightCodes], recipe: Recipe,
                 all_gather: str, fused: list[list[int]] | None = None) -> None:
        self.engine = engine
        self.opt = engine.optimizer
        self.block = block = recipe.weight_block
        #: ``ds_nvfp4.quantize``'s scaling arguments of the layers' weights (4/6 or standard), and its E4M3 bound
        self.scaling = recipe.weight
        self.e4m3_bound = recipe.weight.e4m3_bound
        self.all_gather = all_gather
        #: what a partition sends in a gather and how the gathered bytes become the weight (zero/wire.py)
        self.wire: WireFormat = wire_format(all_gather)
        self.entries: dict[int, Entry] = {}
        self.by_group: list[list[Entry]] = []
        self.kept_bf16: dict[str, str] = {}
        self.compact: dict[int, torch.Tensor] = {}
        self.packed = False
        self.gathered_bytes = 0
        #: wall seconds spent re-packing after steps and dequantizing before gathers (for bench/zero.py)
        self.seconds = {"pack": 0.0, "dequantize_for_gather": 0.0}
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.dist = dist
        self.not_available = ZeroParamStatus.NOT_AVAILABLE  # looked up once: _needs runs on every gather
        self.comm_device = torch.device(get_accelerator().current_device_name())
        for sid, params in enumerate(self.opt.fp16_groups):
            pg = self.opt.sub_group_process_groups[sid]
            ws, rank = dist.get_world_size(group=pg), dist.get_rank(group=pg)
            group, off = [], 0
            for p in params:
                numel = int(p.partition_numel())
                e = Entry(p, names.get(id(p), f"ds_id {p.ds_id}"), sid, off, numel)
                if id(p) in converted:
                    e.codes = converted[id(p)]
                    shape = e.codes.stored_shape or tuple(p.ds_shape)  # DBRX-style 2-D experts: (E, rows, cols)
                    e.layout = partition_layout(tuple(shape), numel, ws, block, rank)
                    if not e.layout.packable:
                        self.kept_bf16[e.name] = e.layout.reason
                group.append(e)
                self.entries[id(p)] = e
                off += numel
            self.by_group.append(group)
        trained = {id(p) for params in self.opt.fp16_groups for p in params}
        #: converted weights that do not train (requires_grad False: a frozen base), packed once by pack_frozen
        self.frozen: list[Entry] = []
        self.frozen_source = "quantized once from their BF16 partitions"
        params = {id(p): p for p in engine.module.parameters()}
        for pid in sorted(set(converted) - trained, key=lambda i: names.get(i, "?")):
            p = params.get(pid)
            if p is None or p.requires_grad or not hasattr(p, "ds_tensor"):
                self.kept_bf16[names.get(pid, "?")] = "not trained (no optimizer partition): stored BF16"
                continue
            pg = p.ds_process_group
            e = Entry(p, names.get(pid, f"ds_id {p.ds_id}"), -1, 0, int(p.partition_numel()), codes=converted[pid],
                      frozen=True)
            e.layout = partition_layout(tuple(e.codes.stored_shape or p.ds_shape), e.numel,
                                        dist.get_world_size(group=pg), block, dist.get_rank(group=pg))
            if not e.layout.packable:
                self.kept_bf16[e.name] = f"frozen, {e.layout.reason}"
            self.entries[pid] = e
            self.frozen.append(e)
        #: fused groups (weights of one inference GEMM) whose amax the store agrees on, per sub-group
        self.fused: dict[int, list[list[Entry]]] = {}
        #: fused groups that cannot share an amax here, with the reason (names joined by ", ")
        self.unfused: dict[str, str] = {}
        for pids in fused or []:
            members = [self.entries.get(pid) for pid in pids]
            label = ", ".join(e.name if e else names.get(pid, "?") for e, pid in zip(members, pids))
            if any(e is None or not e.packable for e in members):
                self.unfused[label] = "a member's partition is stored BF16 (see kept BF16)"
            elif len({e.sub_group for e in members}) > 1:
                self.unfused[label] = ("its members sit in different optimizer sub-groups (raise "
                                       "zero_optimization.sub_group_size)")
            else:
                self.fused.setdefault(members[0].sub_group, []).append(members)

    # ---- packing -------------------------------------------------------------------------------------------
    def pack_group(self, sid: int) -> None:
        """Re-derive sub-group ``sid``'s storage from its FP32 master partition (after a step or a load)."""
        t0 = time.perf_counter()
        self._pack_group(sid)
        self.seconds["pack"] += time.perf_counter() - t0

    def _pack_group(self, sid: int) -> None:
        fp32 = self.opt.fp32_partitioned_groups_flat[sid]
        group = self.by_group[sid]
        packable = [e for e in group if e.packable]
        if packable:
            # one amax per 2-D weight, one per expert of a 3-D one: all of them in one vector
            parts = [local_amax(fp32.narrow(0, e.offset, e.numel), e.layout).reshape(-1) for e in packable]
            sizes = [t.numel() for t in parts]
            # one collective per sub-group: the per-tensor amax must be the max over every rank's partition
            # (NaN-safe: a non-finite master stops every rank with the same error, see agree_max)
            agreed, bad = agree_max(torch.cat(parts), group=self.opt.sub_group_process_groups[sid])
            agreed, bad = agreed.split(sizes), [bool(b.any()) for b in bad.split(sizes)]
            if any(bad):
                names = [e.name for e, b in zip(packable, bad) if b]
                raise NonFiniteError(f"ds_nvfp4: the FP32 master weights of {', '.join(names[:4])} hold NaN/Inf "
                                     "on some rank after an optimizer step whose gradients were finite (an "
                                     "unstable update): they are not packed; resume from the last checkpoint, "
                                     "e.g. with a lower learning rate")
            amaxes = [a.reshape(()) if e.layout.experts is None else a for e, a in zip(packable, agreed)]
            fused = self.fused.get(sid, ())
            if fused:  # one global scale per fused inference GEMM (2-D weights): every member takes the group's max
                index = {id(e): i for i, e in enumerate(packable)}
                scalar = [i for i, e in enumerate(packable) if e.layout.experts is None]
                at = {i: j for j, i in enumerate(scalar)}
                shared = share_amax(torch.stack([amaxes[i] for i in scalar]),
                                    [[at[index[id(e)]] for e in members] for members in fused])
                for i, j in at.items():
                    amaxes[i] = shared[j]
            for e, amax in zip(packable, amaxes):
                q = pack_partition(fp32.narrow(0, e.offset, e.numel).detach(), e.layout, self.block, amax,
                                   scaling=self.scaling)
                e.q = q.to(e.param.ds_tensor.device)
                e.codes.agreed_amax = amax.to(e.param.ds_tensor.device).clone()
                e.param.ds_tensor.data = _placeholder(e.param.ds_tensor)
        rest = [e for e in group if not e.packable]
        if rest:
            dtype, dev = rest[0].param.ds_tensor.dtype, rest[0].param.ds_tensor.device
            total = sum(e.numel for e in rest)
            buf = self.compact.get(sid)
            if buf is None or buf.numel() != total:
                buf = self.compact[sid] = torch.empty(total, dtype=dtype, device=dev)
            off = 0
            for e in rest:
                view = buf.narrow(0, off, e.numel)
                view.copy_(fp32.narrow(0, e.offset, e.numel).detach())
                e.param.ds_tensor.data = view
                off += e.numel

    def pack_frozen(self, sources: dict[int, FrozenSource] | None = None, described: str = "") -> None:
        """Pack every frozen weight's partition once: from ``sources`` (``id(param)`` -> its stored codes, e.g. a
        published checkpoint's, used exactly as stored) or else quantized from its BF16 partition with the amax
        agreed across its ranks. Frozen partitions stay packed in every phase (BF16 schedule phases included: the
        layers then gather and multiply their dequantized values) and through checkpoint loading."""
        sources = sources or {}
        todo = [e for e in self.frozen if e.packable]
        own = [e for e in todo if id(e.param) not in sources]
        groups: dict[int, list[Entry]] = {}
        for e in own:
            groups.setdefault(id(e.param.ds_process_group), []).append(e)
        amax: dict[int, torch.Tensor] = {}
        for members in groups.values():
            parts = [local_amax(e.param.ds_tensor.data, e.layout).reshape(-1) for e in members]
            agreed, bad = agree_max(torch.cat(parts).float(), group=members[0].param.ds_process_group)
            sizes = [t.numel() for t in parts]
            for e, a, b in zip(members, agreed.split(sizes), bad.split(sizes)):
                if bool(b.any()):
                    raise NonFiniteError(f"ds_nvfp4: the frozen weight {e.name} holds NaN/Inf: it cannot be packed")
                amax[id(e.param)] = a.reshape(()) if e.layout.experts is None else a
        for e in todo:
            dev = e.param.ds_tensor.device
            if id(e.param) in sources:
                rank = self.dist.get_rank(group=e.param.ds_process_group)
                codes = sources[id(e.param)](rank * e.numel, (rank + 1) * e.numel)
                e.q, a = partition_from_codes(codes, e.layout), codes[2]
            else:
                a = amax[id(e.param)]
                e.q = pack_partition(e.param.ds_tensor.data.float(), e.layout, self.block, a, scaling=self.scaling)
            e.q = e.q.to(dev)
            e.codes.agreed_amax = a.to(dev).clone()
            e.param.ds_tensor.data = _placeholder(e.param.ds_tensor)
        if sources:
            self.frozen_source = described or "read from their source as stored"

    def set_master(self, param: torch.nn.Parameter, local: torch.Tensor) -> None:
        """This rank's FP32 master partition of a trained ``param`` := ``local`` (``[partition_numel]``); DeepSpeed's
        ``safe_set_local_fp32_param`` checks the size against the BF16 partition, which packing emptied. Call
        :meth:`pack_all` after the last one."""
        e = self.entries[id(param)]
        with torch.no_grad():
            self.opt.fp32_partitioned_groups_flat[e.sub_group].narrow(0, e.offset, e.numel).copy_(local.reshape(-1))

    def pack_all(self) -> None:
        for sid in range(len(self.by_group)):
            self.pack_group(sid)
            flat = self.opt.fp16_partitioned_groups_flat[sid]
            if flat is not None:
                # DeepSpeed's flat BF16 view is gone: any code path we did not wrap fails on size, loudly
                self.opt.fp16_partitioned_groups_flat[sid] = _placeholder(flat)
        for attr in ("lp_param_buffer",):
            buf = getattr(self.opt, attr, None)
            if isinstance(buf, torch.Tensor):
                setattr(self.opt, attr, _placeholder(buf))
        if isinstance(getattr(self.opt, "param_groups_fp16_flat_cpu_memory", None), list):
            self.opt.param_groups_fp16_flat_cpu_memory = [_placeholder(t) for t in
                                                          self.opt.param_groups_fp16_flat_cpu_memory]
        self.packed = True

    def unpack_all(self) -> None:
        """Back to DeepSpeed's own layout: one flat BF16 tensor per sub-group, every ds_tensor a view into it."""
        for sid, group in enumerate(self.by_group):
            if not group:
                continue
            ref = group[0].param.ds_tensor
            flat = torch.empty(sum(e.numel for e in group), dtype=ref.dtype, device=ref.device)
            for e in group:
                view = flat.narrow(0, e.offset, e.numel)
                view.copy_(unpack_partition(e.q, ref.dtype) if e.packable else e.param.ds_tensor.data)
                e.param.ds_tensor.data = view
            self.opt.fp16_partitioned_groups_flat[sid] = flat
        self.compact.clear()
        self.packed = False

    def unpack_to_bf16(self) -> None:
        """Store every partition the DeepSpeed way, in BF16 from the FP32 masters (``precision.schedule``'s BF16
        phases): DeepSpeed's optimizer then copies FP32 -> BF16 after each step as it does without ds_nvfp4."""
        self.unpack_all()
        for sid, group in enumerate(self.by_group):
            if group:
                self.opt.fp16_partitioned_groups_flat[sid].copy_(self.opt.fp32_partitioned_groups_flat[sid])
        for e in self.entries.values():
            if e.packable and not e.frozen:
                e.codes.agreed_amax = None  # a BF16 weight's forward derives its own amax

    def refresh_persistent(self) -> None:
        """ZeRO-3 keeps small (persistent) parameters gathered: re-gather the converted ones after their storage
        changed, so every rank's forward sees the stored weight."""
        persistent = [p for p in getattr(self.opt, "persistent_parameters", [])
                      if self.entries.get(id(p)) is not None and self.entries[id(p)].packable]
        if persistent:
            persistent[0].partition(persistent)
            persistent[0].all_gather(persistent)

    @contextlib.contextmanager
    def flat_layout(self):
        """Run DeepSpeed code that expects its flat BF16 buffers (checkpoint loading), then re-pack from FP32."""
        was = self.packed
        if was:
            self.unpack_all()
        try:
            yield
        finally:
            if was:
                self.pack_all()

    # ---- used by the gather hooks (zero/gather.py) ---------------------------------------------------------
    def holds_packed(self, e: Entry) -> bool:
        """Whether ``e``'s partition is stored packed now (trained weights outside BF16 phases; frozen ones always,
        once packed)."""
        return e.packable and (self.packed or e.frozen) and e.q is not None

    def needs(self, params) -> list[Entry]:
        out = []
        for p in params:
            e = self.entries.get(id(p))
            if e is not None and self.holds_packed(e) and p.ds_status == self.not_available:
                out.append(e)
        return out

    def world_size(self, e: Entry) -> int:
        return self.dist.get_world_size(group=e.param.ds_process_group)

    def repack_from_full(self, e: Entry) -> None:
        """``GatheredParameters(modifier_rank=...)`` exit: the full weight may have changed on every rank.

        Keeps the packed bytes when no rank's partition changed (re-packing dequantized values would drift codes);
        otherwise re-quantizes every rank's partition with the amax of the new full weight (the same on all ranks,
        which all hold the full weight here).
        """
        p = e.param
        full = p.data.reshape(-1)
        rank = self.dist.get_rank(group=p.ds_process_group)
        mine = full.narrow(0, rank * e.numel, e.numel)
        changed = torch.tensor([0.0 if torch.equal(mine.to(p.ds_tensor.dtype),
                                                   unpack_partition(e.q, p.ds_tensor.dtype).to(mine.device)) else 1.0],
                               device=self.comm_device)
        self.dist.all_reduce(changed, op=self.dist.ReduceOp.MAX, group=p.ds_process_group)
        if changed.item() == 0:
            return
        if e.layout.experts is None:
            amax = full.detach().float().abs().amax()
        else:
            amax = full.detach().float().abs().reshape(e.layout.experts, -1).amax(1)
        e.q = pack_partition(mine.detach().float(), e.layout, self.block, amax,
                             scaling=self.scaling).to(p.ds_tensor.device)
        e.codes.agreed_amax = amax.to(p.ds_tensor.device)

    # ---- reporting ------------------------------------------------------------------------------------------
    def report(self) -> StorageReport:
        r = StorageReport(rank=self.dist.get_rank(), all_gather=self.all_gather, kept_bf16=dict(self.kept_bf16),
                          gathered_bytes=self.gathered_bytes)
        r.frozen_source = self.frozen_source
        for e in self.entries.values():
            if self.holds_packed(e):
                r.packed_params += 1
                r.packed_bytes += e.q.nbytes
                r.packed_bf16_equivalent_bytes += e.numel * 2
                if e.frozen:
                    r.frozen_params += 1
                    r.frozen_bytes += e.q.nbytes
            else:
                r.bf16_params += 1
                r.bf16_bytes += e.numel * e.param.ds_tensor.element_size()
        return r
