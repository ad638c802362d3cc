"""NVFP4 storage of ZeRO-3 weight partitions: packing, gather hooks, and the optimizer seam.

Design (see docs/zero.md and the DeepSpeed 0.19.8 seams it relies on, all checked by guard.py):

* After ``deepspeed.initialize`` every converted, trainable, block-aligned weight partition is re-packed from the
  FP32 master partition: E2M1 codes + E4M3 scales + the FP32 amax agreed across the partition group (one
  ``all_reduce(MAX)`` per optimizer sub-group). The ``ds_tensor`` object is kept but its ``.data`` becomes an
  empty BF16 tensor, so a DeepSpeed path this module does not know fails loudly instead of gathering garbage.
  BF16 partitions of everything else move to one compact buffer per sub-group; DeepSpeed's flat BF16 buffer is
  released.
* The three per-parameter closures DeepSpeed uses for every gather (``all_gather``, ``all_gather_coalesced``,
  ``partition``) are wrapped: with ``communication.all_gather: "bf16"`` the partition is dequantized just before
  DeepSpeed's own gather and the transient dropped after the handle's ``wait()``; with ``"nvfp4"`` the packed bytes
  and scales are gathered and dequantized after (same bits, ~3.5x less traffic).
* The optimizer gets a per-instance mixin: after each sub-group step the partition is re-quantized from the FP32
  master (instead of DeepSpeed's FP32 -> BF16 copy); checkpoint loading runs DeepSpeed's own code on a temporary
  flat BF16 layout and re-packs from the loaded FP32 master.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from ..format import NVFP4Tensor
from ..nn.linear import GATHERED_CODES_ATTR, WEIGHT_AMAX_ATTR
from ..nn.nonfinite import NonFiniteError
from .collectives import agree_max
from .partition import PartitionLayout, pack_partition, partition_layout, unpack_partition

log = logging.getLogger("ds_nvfp4")


@dataclass
class Entry:
    """One parameter of one optimizer sub-group, with where its partition sits in the sub-group's flat."""

    param: torch.nn.Parameter
    name: str
    sub_group: int
    offset: int
    numel: int
    layout: PartitionLayout | None = None   # None: not a converted weight
    q: NVFP4Tensor | None = None            # the packed partition when packable

    @property
    def packable(self) -> bool:
        return self.layout is not None and self.layout.packable


@dataclass
class StorageReport:
    """Per-rank storage of the model's partitions (bytes are this rank's resident partition bytes)."""

    rank: int
    all_gather: str
    packed_params: int = 0
    packed_bytes: int = 0
    packed_bf16_equivalent_bytes: int = 0
    bf16_params: int = 0
    bf16_bytes: int = 0
    kept_bf16: dict[str, str] = field(default_factory=dict)   # converted weights stored BF16, with the reason
    gathered_bytes: int = 0                                     # bytes received by gathers of packed weights

    @property
    def ratio(self) -> float:
        """Packed bytes / the BF16 bytes the same partitions would take."""
        return self.packed_bytes / self.packed_bf16_equivalent_bytes if self.packed_bf16_equivalent_bytes else 1.0

    def summary(self) -> str:
        s = (f"ds_nvfp4 storage rank {self.rank}: {self.packed_params} weight partitions packed NVFP4, "
             f"{self.packed_bytes:,} bytes vs {self.packed_bf16_equivalent_bytes:,} in BF16 ({self.ratio:.4f}x); "
             f"{self.bf16_params} partitions BF16 ({self.bf16_bytes:,} bytes); all-gather {self.all_gather}")
        for name, why in self.kept_bf16.items():
            s += f"\n  converted weight kept BF16: {name}: {why}"
        return s

    def to_dict(self) -> dict:
        from dataclasses import asdict

        d = asdict(self)
        d["ratio"] = self.ratio
        return d


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device)


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

    def __init__(self, store: NVFP4Store, entries: list[Entry]) -> None:
        from deepspeed import comm as dist
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        # Every rank must concatenate the same parameters in the same order (DeepSpeed sorts by ds_id too:
        # callers hand over parameters in a per-rank order).
        entries = sorted(entries, key=lambda e: e.param.ds_id)
        self.store, self.entries, self.status = store, entries, ZeroParamStatus
        group = entries[0].param.ds_process_group
        self.world = dist.get_world_size(group=group)
        comm_dev = store.comm_device
        parts = []
        for e in entries:
            e.param.ds_status = ZeroParamStatus.INFLIGHT
            parts += [e.q.data.reshape(-1), e.q.scale.view(torch.uint8).reshape(-1)]
        send = torch.cat(parts).to(comm_dev)
        self.recv = torch.empty(send.numel() * self.world, dtype=torch.uint8, device=comm_dev)
        dist.all_gather_into_tensor(self.recv, send, group=group)
        store.gathered_bytes += self.recv.numel()
        self.per_rank = send.numel()
        self.done = False

    def wait(self, *args, **kwargs) -> None:
        if self.done:
            return
        chunks = self.recv.view(self.world, self.per_rank)
        off = 0
        for e in self.entries:
            q = e.q
            nd, ns = q.data.numel(), q.scale.numel()
            data = chunks[:, off:off + nd].reshape(-1, q.data.shape[-1])
            scale = chunks[:, off + nd:off + nd + ns].contiguous().view(torch.float8_e4m3fn)
            scale = scale.reshape(-1, q.scale.shape[-1])
            off += nd + ns
            rows = q.shape[0] * self.world
            full = NVFP4Tensor(data.to(q.device), scale.to(q.device), q.amax, torch.Size((rows, q.shape[1])), q.block)
            p = e.param
            p.data = full.dequantize(p.ds_tensor.dtype).reshape(-1)[: p.ds_numel].view(p.ds_shape).to(p.device)
            k = p.ds_shape[-1]  # the codes in the weight's own [N, K] block layout (no padding: packable)
            setattr(p, GATHERED_CODES_ATTR, ((p.data_ptr(), p._version),
                                             (full.data.reshape(-1, k // 2).to(p.device),
                                              full.scale.reshape(-1, k // 16).to(p.device), q.amax.to(p.device))))
            p.ds_status = self.status.AVAILABLE
        self.done = True


class NVFP4Store:
    """Owns the packed partitions of one engine. Created and installed by ``ds_nvfp4.initialize``."""

    def __init__(self, engine, names: dict[int, str], converted: set[int], block: str, all_gather: str,
                 fused: list[list[int]] | None = None) -> None:
        self.engine = engine
        self.opt = engine.optimizer
        self.block = block
        self.all_gather = all_gather
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
            ws = dist.get_world_size(group=self.opt.sub_group_process_groups[sid])
            group, off = [], 0
            for p in params:
                numel = int(p.partition_numel())
                e = Entry(p, names.get(id(p), f"ds_id {p.ds_id}"), sid, off, numel)
                if id(p) in converted:
                    e.layout = partition_layout(tuple(p.ds_shape), numel, ws, block)
                    if not e.layout.packable:
                        self.kept_bf16[e.name] = e.layout.reason
                group.append(e)
                self.entries[id(p)] = e
                off += numel
            self.by_group.append(group)
        trained = {id(p) for params in self.opt.fp16_groups for p in params}
        for pid in converted - trained:
            self.kept_bf16[names.get(pid, "?")] = "not trained (no optimizer partition): stored BF16"
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
            local = torch.stack([fp32.narrow(0, e.offset, e.numel).detach().abs().amax().float()
                                 for e in packable])
            # one collective per sub-group: the per-tensor amax must be the max over every rank's partition
            # (NaN-safe: a non-finite master stops every rank with the same error, see agree_max)
            local, bad = agree_max(local, group=self.opt.sub_group_process_groups[sid])
            if bool(bad.any()):
                names = [e.name for e, b in zip(packable, bad.tolist()) if b]
                raise NonFiniteError(f"ds_nvfp4: the FP32 master weights of {', '.join(names[:4])} hold NaN/Inf "
                                     "on some rank after an optimizer step whose gradients were finite (an "
                                     "unstable update): they are not packed; resume from the last checkpoint, "
                                     "e.g. with a lower learning rate")
            index = {id(e): i for i, e in enumerate(packable)}
            for members in self.fused.get(sid, ()):
                # one global scale per fused inference GEMM: every member takes the group's max
                at = [index[id(e)] for e in members]
                local[at] = local[at].max()
            for e, amax in zip(packable, local):
                q = pack_partition(fp32.narrow(0, e.offset, e.numel).detach(), e.layout, self.block, amax.clone())
                e.q = q.to(e.param.ds_tensor.device)
                setattr(e.param, WEIGHT_AMAX_ATTR, e.q.amax)
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
            if e.packable and hasattr(e.param, WEIGHT_AMAX_ATTR):
                delattr(e.param, WEIGHT_AMAX_ATTR)  # a BF16 weight's forward derives its own amax

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

    # ---- gather hooks ---------------------------------------------------------------------------------------
    def _needs(self, params) -> list[Entry]:
        out = []
        for p in params:
            e = self.entries.get(id(p))
            if e is not None and e.packable and self.packed and p.ds_status == self.not_available:
                out.append(e)
        return out

    def _materialize(self, entries: list[Entry]) -> None:
        t0 = time.perf_counter()
        for e in entries:
            e.param.ds_tensor.data = unpack_partition(e.q, e.param.ds_tensor.dtype)
            self.gathered_bytes += e.numel * e.param.ds_tensor.element_size() * self._world(e)
        self.seconds["dequantize_for_gather"] += time.perf_counter() - t0

    def _world(self, e: Entry) -> int:
        return self.dist.get_world_size(group=e.param.ds_process_group)

    @staticmethod
    def _release(entries: list[Entry]) -> None:
        for e in entries:
            e.param.ds_tensor.data = _placeholder(e.param.ds_tensor)

    def install_hooks(self) -> None:
        for e in self.entries.values():
            self._wrap(e.param)

    def _wrap(self, p) -> None:
        store = self
        orig_coalesced, orig_gather, orig_partition = p.all_gather_coalesced, p.all_gather, p.partition

        def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False):
            params = list(params)
            mine = store._needs(params)
            if store.all_gather == "nvfp4" and mine:
                ids = {id(e.param) for e in mine}
                rest = [q for q in params if id(q) not in ids]
                handles = [_PackedGatherHandle(store, mine)]
                if rest:
                    handles.insert(0, orig_coalesced(rest, safe_mode=safe_mode, quantize=quantize))
                return _MultiHandle(handles)
            store._materialize(mine)
            return _ReleaseHandle(orig_coalesced(params, safe_mode=safe_mode, quantize=quantize),
                                  lambda: store._release(mine))

        def all_gather(param_list=None, async_op: bool = False, hierarchy: int = 0):
            params = [p] if param_list is None else list(param_list)
            mine = store._needs(params)
            if store.all_gather == "nvfp4" and mine and not async_op:
                ids = {id(e.param) for e in mine}
                _PackedGatherHandle(store, mine).wait()
                rest = [q for q in params if id(q) not in ids]
                return orig_gather(rest, async_op=False, hierarchy=hierarchy) if rest else None
            store._materialize(mine)
            ret = orig_gather(params, async_op=async_op, hierarchy=hierarchy)
            if not async_op:
                store._release(mine)
                return ret
            # the transients may be read by any of the handles: drop them once every handle has waited
            pending = {"left": len(ret)}

            def one_done() -> None:
                pending["left"] -= 1
                if pending["left"] == 0:
                    store._release(mine)

            if not ret:
                store._release(mine)
            return [_ReleaseHandle(h, one_done) for h in ret]

        def partition(param_list=None, hierarchy: int = 0, has_been_updated: bool = False, free_data: bool = True):
            params = [p] if param_list is None else list(param_list)
            for q in params:  # released: the gathered codes go with the gathered weight
                if hasattr(q, GATHERED_CODES_ATTR):
                    delattr(q, GATHERED_CODES_ATTR)
            if not has_been_updated or not store.packed:
                return orig_partition(params, hierarchy=hierarchy, has_been_updated=has_been_updated,
                                      free_data=free_data)
            mine = [store.entries[id(q)] for q in params if id(q) in store.entries and store.entries[id(q)].packable]
            ids = {id(e.param) for e in mine}
            for e in mine:
                store._repack_from_full(e)
            rest = [q for q in params if id(q) not in ids]
            if mine:
                orig_partition([e.param for e in mine], hierarchy=hierarchy, has_been_updated=False,
                               free_data=free_data)
            if rest:
                orig_partition(rest, hierarchy=hierarchy, has_been_updated=True, free_data=free_data)

        p.all_gather_coalesced, p.all_gather, p.partition = all_gather_coalesced, all_gather, partition

    def _repack_from_full(self, e: Entry) -> None:
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
        amax = full.detach().float().abs().amax()
        e.q = pack_partition(mine.detach().float(), e.layout, self.block, amax).to(p.ds_tensor.device)
        setattr(p, WEIGHT_AMAX_ATTR, e.q.amax)

    # ---- reporting ------------------------------------------------------------------------------------------
    def report(self) -> StorageReport:
        r = StorageReport(rank=self.dist.get_rank(), all_gather=self.all_gather, kept_bf16=dict(self.kept_bf16),
                          gathered_bytes=self.gathered_bytes)
        for e in self.entries.values():
            if e.packable and self.packed:
                r.packed_params += 1
                r.packed_bytes += e.q.nbytes
                r.packed_bf16_equivalent_bytes += e.numel * 2
            else:
                r.bf16_params += 1
                r.bf16_bytes += e.numel * e.param.ds_tensor.element_size()
        return r


class NVFP4OptimizerMixin:
    """Mixed into the engine's ZeRO-3 optimizer instance (``opt.__class__ = type(..., (Mixin, type(opt)), {})``)."""

    _ds_nvfp4_store: NVFP4Store

    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        store = self._ds_nvfp4_store
        if not store.packed:
            return super()._reassign_or_swap_out_partitioned_parameters(sub_group_id)
        store.pack_group(sub_group_id)

    def load_state_dict(self, *args, **kwargs):
        with self._ds_nvfp4_store.flat_layout():
            return super().load_state_dict(*args, **kwargs)

    def _restore_from_bit16_weights(self):
        with self._ds_nvfp4_store.flat_layout():
            return super()._restore_from_bit16_weights()

    def load_module_checkpoint_state_from_checkpoint_dir_stage3(self, *args, **kwargs):
        with self._ds_nvfp4_store.flat_layout():
            return super().load_module_checkpoint_state_from_checkpoint_dir_stage3(*args, **kwargs)


def install(engine, names: dict[int, str], converted: set[int], block: str, all_gather: str,
            fused: list[list[int]] | None = None) -> NVFP4Store:
    """Pack the engine's converted ZeRO-3 weights and hook DeepSpeed (called by ``ds_nvfp4.initialize``).

    ``fused`` lists groups of parameter ids (weights of one fused inference GEMM) that share one amax.
    """
    from .guard import check_engine

    opt = engine.optimizer
    check_engine(opt, engine.module.parameters())
    store = NVFP4Store(engine, names, converted, block, all_gather, fused)
    base = type(opt)
    opt.__class__ = type(f"NVFP4{base.__name__}", (NVFP4OptimizerMixin, base), {})
    opt._ds_nvfp4_store = store
    opt._partition_all_parameters()
    store.pack_all()
    store.install_hooks()
    # persistent parameters still hold their pre-packing BF16 values: the forward must see the packed weight
    store.refresh_persistent()
    return store
