"""Count the bytes every torch.distributed collective moves, per operation, by wrapping the collectives.

``install()`` replaces the collectives of ``torch.distributed`` with wrappers that add each call's payload to
:data:`COUNTS` and then call the original. It must run before ``deepspeed.init_distributed``: DeepSpeed's torch
backend captures ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` when it is built. ds_nvfp4's own gathers go
through ``deepspeed.comm`` and are counted the same way.

Payload per call, in bytes, as seen by one rank: a gather's output (the whole gathered tensor), a reduce-scatter's
input (the whole unreduced tensor), an all-reduce's or broadcast's tensor. What a ring algorithm puts on each rank's
link is a fixed share of it: :func:`wire_share`.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict

import torch
import torch.distributed as tdist

#: op -> [calls, payload bytes] since the last :func:`reset`
COUNTS: dict[str, list[int]] = defaultdict(lambda: [0, 0])

# the tensor argument(s) whose size is the payload, by collective
_PAYLOAD = {"all_gather_into_tensor": "output_tensor", "_all_gather_base": "output_tensor",
            "all_gather": "tensor_list", "reduce_scatter_tensor": "input", "_reduce_scatter_base": "input",
            "reduce_scatter": "input_list", "all_reduce": "tensor", "all_reduce_coalesced": "tensors",
            "broadcast": "tensor", "reduce": "tensor", "all_to_all_single": "input"}
#: op -> its family in the reports
FAMILY = {"all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather", "all_gather": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
          "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
          "broadcast": "broadcast", "reduce": "reduce", "all_to_all_single": "all_to_all"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0


def install() -> None:
    """Wrap every collective of :data:`_PAYLOAD` in ``torch.distributed`` (idempotent)."""
    for op, arg in _PAYLOAD.items():
        fn = getattr(tdist, op, None)
        if fn is None or getattr(fn, "_counted", False):
            continue
        sig = inspect.signature(fn)

        def wrapper(*a, _fn=fn, _op=op, _arg=arg, _sig=sig, **k):
            c = COUNTS[_op]
            c[0] += 1
            c[1] += _nbytes(_sig.bind(*a, **k).arguments.get(_arg))
            return _fn(*a, **k)

        wrapper = functools.wraps(fn)(wrapper)
        wrapper._counted = True
        setattr(tdist, op, wrapper)


def reset() -> None:
    COUNTS.clear()


def by_family() -> dict[str, dict[str, int]]:
    """``{family: {"calls": n, "bytes": payload}}`` of the counts so far."""
    out: dict[str, dict[str, int]] = {}
    for op, (calls, nbytes) in COUNTS.items():
        f = out.setdefault(FAMILY[op], {"calls": 0, "bytes": 0})
        f["calls"] += calls
        f["bytes"] += nbytes
    return out


def wire_share(family: str, world: int) -> float:
    """Bytes a rank sends per payload byte in a ring (bandwidth-optimal) algorithm of ``world`` ranks."""
    n = world
    return {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
            "broadcast": 1.0, "reduce": 1.0, "all_to_all": (n - 1) / n}[family]
