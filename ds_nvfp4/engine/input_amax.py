"""Each NVFP4 layer's running input amax agreed across ranks: the static activation scale of a W4A4 export."""

from __future__ import annotations

import math

import torch

from ..nn.module import FP4Module


def _local(module: torch.nn.Module) -> dict[str, float | None]:
    """This rank's table: one value per Linear/Conv1D weight, one per expert of an experts weight
    (``"<module>.<parameter>.<expert>"``)."""
    out: dict[str, float | None] = {}
    for n, m in module.named_modules():
        if not isinstance(m, FP4Module):
            continue
        if isinstance(m.input_amax, dict):
            for pname, amax in m.input_amax.items():
                out.update({f"{n}.{pname}.{e}": float(v) if v > 0 else None for e, v in enumerate(amax.tolist())})
            for pname, _, _ in m.fp4_weights():
                if pname not in m.input_amax:
                    out.update({f"{n}.{pname}.{e}": None for e in range(m.site.experts)})
        else:
            out[n] = float(m.input_amax) if m.input_amax is not None else None
    return out


def agreed_input_amax(module: torch.nn.Module) -> dict[str, float | None]:
    """``{layer: max over ranks and training forwards of max|input|}`` (experts: ``{module.param.expert: ...}``),
    None where no rank observed it (the running max keeps finite values only). One collective (every rank must call
    it); ranks may hold different layers (pipeline stages), so the per-rank tables are gathered and merged by name
    rather than all-reduced as vectors."""
    import deepspeed.comm as dist

    local = _local(module)
    tables = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        tables = [None] * dist.get_world_size()
        dist.all_gather_object(tables, local)
    merged: dict[str, float | None] = {}
    for table in tables:
        for name, value in table.items():
            ok = value is not None and math.isfinite(value)
            if name not in merged or merged[name] is None:
                merged[name] = value if ok else None
            elif ok:
                merged[name] = max(merged[name], value)
    return merged
