"""Feature ``statistics`` (``precision.monitor``): per-layer quantization statistics in DeepSpeed's monitor.

Captured on every ``monitor.interval``-th optimizer step (a forward pre-hook turns capture on for training forwards)
and written to TensorBoard/CSV/W&B as configured, as ``Train/Precision/<layer>/...`` at that step (counted from 1,
like DeepSpeed's own events), with no change to the user's training loop.
"""

from __future__ import annotations

from ..nn import StatsCollector
from .lifecycle import Feature, StepOutcome
from .state import NVFP4State


class Statistics(Feature):
    name = "statistics"

    def __init__(self, engine, interval: int) -> None:
        self.engine = engine
        self.collector = StatsCollector(engine.module, interval)

        def before_forward(module, args):
            if module.training:
                self.collector.step(engine.global_steps + 1)

        engine.module.register_forward_pre_hook(before_forward)

    def after_step(self, state: NVFP4State, outcome: StepOutcome) -> None:
        events = self.collector.events(outcome.step)
        self.collector.stop()  # evaluation forwards until the next training forward are not captured
        if events and self.engine.monitor.enabled:
            self.engine.monitor.write_events(events)  # DeepSpeed's monitor writes on rank 0 only
