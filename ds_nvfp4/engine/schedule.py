"""Feature ``schedule`` (``precision.schedule``): the engine in the phase of its next optimizer step.

Applied at ``initialize``, after every optimizer step and after a checkpoint load (the phase is a function of the
step number: config/schedule.py), so a resumed run takes the same phase at the same step. With a DeepSpeed monitor,
``Train/Precision/fp4_forward`` and ``fp4_backward`` (1/0, at the step number) record what each step ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config.schedule import Phase, SchedulePlan
from .announce import announce
from .lifecycle import Feature, LoadContext, StepOutcome
from .state import NVFP4State


@dataclass
class ScheduleState:
    """The schedule as the engine runs it: the current phase and every transition (step, phase name)."""

    plan: SchedulePlan
    current: Phase | None = None
    transitions: list[tuple[int, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"warmup_steps": self.plan.warmup_steps, "first_late_step": self.plan.first_late_step,
                "late_gemms": self.plan.late_gemms, "phase": self.current.name if self.current else None,
                "transitions": [{"step": s, "phase": p} for s, p in self.transitions]}


class Schedule(Feature):
    name = "schedule"

    def __init__(self, engine, state: NVFP4State, plan: SchedulePlan, layers: list) -> None:
        self.engine = engine
        self.layers = layers
        self.state = ScheduleState(plan)
        if plan.active:
            state.conversion.notes.append("precision.schedule: " + "; ".join(plan.describe()))

    def start(self, state: NVFP4State) -> None:
        """The phase of the first step (called once the storage is set up)."""
        self._to_next_step(state)

    def _to_next_step(self, state: NVFP4State) -> None:
        step = self.engine.global_steps + 1
        if self.apply(state, step) and self.state.plan.active and state.rank == 0:
            current = self.state.current
            announce(f"ds_nvfp4: precision.schedule: from step {step}, {current.describe()}"
                     + ("" if current.packed or state.store is None else " (weights stored BF16)"))

    def apply(self, state: NVFP4State, step: int) -> bool:
        """Put the layers (and the packed storage, when there is one) in the phase of optimizer step ``step``.
        Returns whether anything changed. Runs between steps: no parameter is gathered then."""
        phase = self.state.plan.phase(step)
        if phase == self.state.current:
            return False
        for m in self.layers:
            m.set_gemm_precision(phase.forward_fp4, phase.backward_fp4)
        store = state.store
        if store is not None and store.packed != phase.packed:
            if phase.packed:
                store.pack_all()
            else:
                store.unpack_to_bf16()
            store.refresh_persistent()
        self.state.current = phase
        self.state.transitions.append((step, phase.name))
        return True

    def after_step(self, state: NVFP4State, outcome: StepOutcome) -> None:
        ran = self.state.current
        if self.state.plan.active and self.engine.monitor.enabled:
            self.engine.monitor.write_events([("Train/Precision/fp4_forward", float(ran.forward_fp4), outcome.step),
                                              ("Train/Precision/fp4_backward", float(ran.backward_fp4),
                                               outcome.step)])
        self._to_next_step(state)

    def after_load(self, state: NVFP4State, load: LoadContext) -> None:
        self._to_next_step(state)
