"""Each NVFP4 layer's running input amax agreed across ranks: the static activation scale of a W4A4 export."""

from __future__ import annotations

import math

import torch

from ..nn import NVFP4Linear


def agreed_input_amax(module: torch.nn.Module) -> dict[str, float | None]:
    """``{layer: max over ranks and training forwards of max|input|}``, None where a rank never observed it or saw
    NaN/Inf. One collective (every rank must call it); ranks may hold different layers (pipeline stages), so the
    per-rank tables are gathered and merged by name rather than all-reduced as vectors."""
    import deepspeed.comm as dist

    local = {n: float(m.input_amax) if m.input_amax is not None else None
             for n, m in module.named_modules() if isinstance(m, NVFP4Linear)}
    tables = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        tables = [None] * dist.get_world_size()
        dist.all_gather_object(tables, local)
    merged: dict[str, float | None] = {}
    for table in tables:
        for name, value in table.items():
            ok = value is not None and math.isfinite(value)
            if name not in merged:
                merged[name] = value if ok else None
            elif merged[name] is not None:
                merged[name] = max(merged[name], value) if ok else None
    return merged
