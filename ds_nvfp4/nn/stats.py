"""Per-layer quantization statistics, captured only on the steps the monitor asks for.

For each tensor the FP4 path quantizes (input, weight, output gradient): the fraction of non-zero elements
flushed to zero, the fraction that saturated (|x| beyond the block's +-6 range after scaling), the relative
quantization error ``||x - Q(x)|| / ||x||`` and the amax. They cost an extra quantization, so they are computed
only when ``capture`` is on (``StatsCollector.step`` turns it on every ``monitor.interval`` steps).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..format import hadamard, quantize


def tensor_stats(x: torch.Tensor, block: str = "1x16", amax: torch.Tensor | None = None,
                 **scaling) -> dict[str, float]:
    """Statistics of quantizing ``x`` ``[..., K]`` (nearest rounding) as python floats; ``scaling``: the
    ``scaling``/``e4m3_bound``/``error`` arguments of ``ds_nvfp4.quantize`` (a weight's 4/6 recipe)."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    if block == "16x16" and x2.shape[0] % 16:
        block = "1x16"
    q = quantize(x2, block=block, amax=amax, **scaling)
    xf = x2.float()
    deq = q.dequantize(torch.float32)
    unit = q.rowwise_scale().float().repeat_interleave(16, dim=1) * q.global_decode_scale
    nonzero = xf != 0
    flushed = (nonzero & (deq == 0)).sum() / nonzero.sum().clamp(min=1)
    saturated = (xf.abs() > 6.0 * unit * (1 + 2**-20)).float().mean()
    rel_err = (xf - deq).norm() / xf.norm().clamp(min=torch.finfo(torch.float32).tiny)
    return {"flushed_to_zero": float(flushed), "saturated": float(saturated), "rel_error": float(rel_err),
            "amax": float(q.amax)}


class LayerStats:
    """Holds one layer's last snapshot; ``capture`` is set by the collector on monitored steps."""

    def __init__(self) -> None:
        self.capture = False
        self.last: dict[str, float] = {}

    def observe_forward(self, x: torch.Tensor, weight: torch.Tensor, recipe, weight_amax) -> None:
        with torch.no_grad():
            xin = hadamard(x) if recipe.act_hadamard else x
            w = hadamard(weight) if recipe.act_hadamard else weight
            amax = None if (weight_amax is None or recipe.act_hadamard) else weight_amax.float().reshape(())
            self.last.update({f"input/{k}": v for k, v in tensor_stats(xin).items()})
            self.last.update({f"weight/{k}": v for k, v in tensor_stats(w, recipe.weight_block, amax,
                                                                               scaling=recipe.weight).items()})

    def observe_grad(self, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self.last.update({f"grad_output/{k}": v for k, v in tensor_stats(grad).items()})


class StatsCollector:
    """Turns capture on every ``interval`` steps and gathers the snapshots of all NVFP4 layers.

    ``ds_nvfp4.initialize`` drives it and writes the events to DeepSpeed's monitor when ``precision.monitor`` is
    enabled (``engine.ds_nvfp4.stats``). By hand: ``c = StatsCollector(model, interval)``; before each forward
    ``c.step(global_step)``; after backward, ``c.collect()`` returns ``{"<layer>/<tensor>/<stat>": value}`` for a
    captured step (empty otherwise), and ``c.events(step)`` formats them for DeepSpeed's monitor as
    ``Train/Precision/<layer>/...``.
    """

    def __init__(self, model: nn.Module, interval: int) -> None:
        # every FP4 layer (nn/module.py's FP4Module) carries a LayerStats: found by it, so that this file does not
        # import the modules that import it
        self.layers = {name: m for name, m in model.named_modules()
                       if isinstance(getattr(m, "stats", None), LayerStats)}
        self.interval = interval
        self.active = False

    def step(self, global_step: int) -> bool:
        self.active = global_step % self.interval == 0
        for m in self.layers.values():
            m.stats.capture = self.active
            if self.active:
                m.stats.last = {}
        return self.active

    def stop(self) -> None:
        """Capture nothing until the next :meth:`step` says so."""
        self.active = False
        for m in self.layers.values():
            m.stats.capture = False

    def collect(self) -> dict[str, float]:
        if not self.active:
            return {}
        return {f"{name}/{k}": v for name, m in self.layers.items() for k, v in m.stats.last.items()}

    def events(self, step: int) -> Iterable[tuple[str, float, int]]:
        return [(f"Train/Precision/{k}", v, step) for k, v in self.collect().items()]
