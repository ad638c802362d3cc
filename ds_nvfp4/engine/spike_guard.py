"""The loss-spike guard (``precision.schedule.spike_guard``): after a step whose loss jumps, BF16 for a while.

An NVFP4 run can take a loss spike harder than BF16 and never catch up (10M parameters, FP4 from step 1: loss 9.05
against BF16's 3.5 at step 19, +7.6% at the end; docs/results.md). Changing the precision mid-training averts such
instabilities (arXiv 2506.20752); a guard that compares a training signal with its history and takes a bounded
recovery action is GNMR's scheme (arXiv 2606.00539, there on the gradient norm). Here the signal is the step's
**loss**: in the kept runs (1M-10M) a loss above 1.5x the median of the previous 10 steps occurred only at the
warm-up spikes, while the gradient norm crossed 4x its median at ordinary steps too.

:class:`SpikeGuard` is pure (a function of the sequence of (step, loss, ran FP4)), saved and restored as
:meth:`SpikeGuard.to_dict`. The loss it sees is the mean of the losses given to ``engine.backward`` during the step
(a ``PipelineEngine``: the loss ``train_batch`` returns), averaged over all ranks with one all-reduce of two
numbers, so every rank opens the same episodes (:func:`mean_over_ranks`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from ..config.schema import SpikeGuardConfig


@dataclass(frozen=True)
class Episode:
    """One spike: the step whose loss jumped, that loss and the median it is compared with, and the BF16 steps
    ``start .. end`` (inclusive) that follow."""

    detected_at: int
    loss: float
    median: float
    start: int
    end: int

    @property
    def ratio(self) -> float:
        return self.loss / self.median if self.median > 0 else float("inf")


@dataclass
class SpikeGuard:
    """Episodes of the spike guard, found from the losses of the steps so far."""

    config: SpikeGuardConfig
    history: list[float] = field(default_factory=list)  # the last ``window`` losses that were not spikes
    episodes: list[Episode] = field(default_factory=list)
    ignored: list[int] = field(default_factory=list)    # spikes after the budget was spent (reported, no episode)
    last_step: int = 0  # the last step observed (a resumed run sees steps again: not counted twice)

    def bf16_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` (from 1) falls in an episode."""
        return any(e.start <= step <= e.end for e in self.episodes)

    def observe(self, step: int, loss: float, ran_fp4: bool) -> Episode | int | None:
        """The loss of optimizer step ``step``. Returns the new :class:`Episode`, or ``step`` itself for a spike
        past ``max_episodes`` (reported, no episode), or None. Only steps that ran an FP4 GEMM can open an episode
        (a spike in BF16 is not the format's); a spike's loss stays out of the history the median is taken over, and
        so does a non-finite loss (a step DeepSpeed skipped: the ``nonfinite`` feature reports it)."""
        if step <= self.last_step or not math.isfinite(loss):
            return None
        self.last_step = step
        cfg = self.config
        if len(self.history) >= cfg.window and ran_fp4 and not self.bf16_at(step):
            median = statistics.median(self.history)
            if loss > cfg.loss_ratio * median:
                if len(self.episodes) >= cfg.max_episodes:
                    self.ignored.append(step)
                    return step
                ep = Episode(step, loss, median, step + 1, step + cfg.bf16_steps)
                self.episodes.append(ep)
                return ep
        self.history = [*self.history, loss][-cfg.window:]
        return None

    def to_dict(self) -> dict:
        return {"history": list(self.history), "last_step": self.last_step, "ignored": list(self.ignored),
                "episodes": [asdict(e) for e in self.episodes]}

    @classmethod
    def from_dict(cls, config: SpikeGuardConfig, saved: dict) -> SpikeGuard:
        return cls(config, list(saved["history"]), [Episode(**e) for e in saved["episodes"]],
                   list(saved.get("ignored", [])), int(saved["last_step"]))


def mean_over_ranks(total: float, count: int) -> float | None:
    """The mean loss pooled over every rank: sum of ``total`` / sum of ``count`` (one all-reduce of 2 float64
    numbers on the accelerator's device when torch.distributed is up), or None when no rank saw a loss."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    t = torch.tensor([total, float(count)], dtype=torch.float64, device=get_accelerator().current_device_name())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return float(t[0] / t[1]) if t[1] > 0 else None
