"""Feature ``schedule`` (``precision.schedule``): the engine in the phase of its next optimizer step.

Applied at ``initialize``, after every optimizer step and after a checkpoint load (the phase is a function of the
step number: config/schedule.py), so a resumed run takes the same phase at the same step. With a DeepSpeed monitor,
``Train/Precision/fp4_forward`` and ``fp4_backward`` (1/0, at the step number) record what each step ran.

``bf16_from: "lr_decay"``: :class:`LrDecay` watches the learning rate the scheduler sets for the next step (the
same on every rank, so the ranks agree without a collective) and fixes the late switch at the first step whose
learning rate is below the one before, after at least :data:`MIN_STABLE_STEPS` steps at a constant peak: the decay
phase of a warmup-stable-decay schedule (HF ``get_wsd_schedule``, a LambdaLR, ...). A schedule that falls straight
after its warm-up (cosine, linear) has no such step: the run says so once and makes no switch. What was found is
saved in each checkpoint's ds_nvfp4.json (:meth:`Schedule.state_dict`), so a resumed run switches at the same step.

``spike_guard``: :class:`~ds_nvfp4.engine.spike_guard.SpikeGuard` reads each step's loss (pooled over the ranks)
and opens BF16 episodes (phase ``guard``); each one is announced on rank 0, written to the monitor
(``Train/Precision/spike_guard_episodes``, ``Train/Precision/spike_guard_ratio``) and saved with each checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from ..config.schedule import GUARD, Phase, SchedulePlan
from .announce import announce
from .lifecycle import Feature, LoadContext, StepOutcome
from .spike_guard import Episode, SpikeGuard, mean_over_ranks
from .state import NVFP4State

log = logging.getLogger("ds_nvfp4")

#: steps at a constant learning rate that make what follows a decay phase (not the fall right after a warm-up)
MIN_STABLE_STEPS = 2
#: relative change below which two learning rates count as equal (schedulers compute them in float64)
_RTOL = 1e-9


@dataclass
class LrDecay:
    """Finding the first step of learning-rate decay (``bf16_from: "lr_decay"``): a pure function of the sequence of
    learning rates, saved and restored as :meth:`to_dict`."""

    last_lr: float | None = None
    last_step: int = 0       # the step whose learning rate last_lr is (a resumed run sees it again: not counted)
    stable_steps: int = 0    # consecutive steps at the same learning rate, so far
    found: int | None = None  # the first step of decay
    no_plateau_at: int | None = None  # the learning rate fell at this step without a constant stretch before

    @property
    def done(self) -> bool:
        return self.found is not None or self.no_plateau_at is not None

    def observe(self, step: int, lr: float) -> None:
        """``lr``: the learning rate optimizer step ``step`` runs with (known once step ``step - 1`` is done)."""
        if step <= self.last_step:
            return
        last, self.last_lr, self.last_step = self.last_lr, lr, step
        if last is None or self.done:
            return
        if abs(lr - last) <= _RTOL * max(abs(last), 1e-30):
            self.stable_steps += 1
        elif lr < last:
            if self.stable_steps >= MIN_STABLE_STEPS:
                self.found = step
            else:
                self.no_plateau_at = step
        else:
            self.stable_steps = 0  # still rising (warm-up)

    def to_dict(self) -> dict:
        return {"last_lr": self.last_lr, "last_step": self.last_step, "stable_steps": self.stable_steps,
                "found": self.found, "no_plateau_at": self.no_plateau_at}


@dataclass
class ScheduleState:
    """The schedule as the engine runs it: the current phase and every transition (step, phase name)."""

    plan: SchedulePlan
    current: Phase | None = None
    transitions: list[tuple[int, str]] = field(default_factory=list)
    lr_decay: LrDecay | None = None  # bf16_from "lr_decay" only
    guard: SpikeGuard | None = None  # spike_guard only

    def phase(self, step: int) -> Phase:
        """The phase of optimizer step ``step``: the plan's, or a spike-guard episode's where the plan has FP4."""
        planned = self.plan.phase(step)
        return GUARD if self.guard is not None and planned.any_fp4 and self.guard.bf16_at(step) else planned

    def to_dict(self) -> dict:
        return {"warmup_steps": self.plan.warmup_steps, "first_late_step": self.plan.first_late_step,
                "late_gemms": self.plan.late_gemms, "phase": self.current.name if self.current else None,
                "transitions": [{"step": s, "phase": p} for s, p in self.transitions],
                **({"lr_decay": self.lr_decay.to_dict()} if self.lr_decay is not None else {}),
                **({"spike_guard": self.guard.to_dict()} if self.guard is not None else {})}


class Schedule(Feature):
    name = "schedule"

    def __init__(self, engine, state: NVFP4State, plan: SchedulePlan, layers: list) -> None:
        self.engine = engine
        self.layers = layers
        self.state = ScheduleState(plan, lr_decay=LrDecay() if plan.at_lr_decay else None,
                                   guard=SpikeGuard(plan.guard) if plan.guard is not None else None)
        self.wants_loss = plan.guard is not None
        self._said_no_loss = False
        if plan.active:
            state.conversion.notes.append("precision.schedule: " + "; ".join(plan.describe()))

    def start(self, state: NVFP4State) -> None:
        """The phase of the first step (called once the storage is set up)."""
        self._to_next_step(state)

    def _to_next_step(self, state: NVFP4State) -> None:
        step = self.engine.global_steps + 1
        self._watch_lr(state, step)
        if self.apply(state, step) and self.state.plan.active and state.rank == 0:
            current = self.state.current
            announce(f"ds_nvfp4: precision.schedule: from step {step}, {current.describe()}"
                     + ("" if current.packed or state.store is None else " (weights stored BF16)"))

    def apply(self, state: NVFP4State, step: int) -> bool:
        """Put the layers (and the packed storage, when there is one) in the phase of optimizer step ``step``.
        Returns whether anything changed. Runs between steps: no parameter is gathered then."""
        phase = self.state.phase(step)
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
        if self.state.guard is not None:
            self._watch_loss(state, outcome, ran)
        self._to_next_step(state)

    def state_dict(self) -> dict:
        """The schedule as it ran (phases, transitions, what ``lr_decay`` found, the spike guard's episodes)."""
        return self.state.to_dict()

    def load_state_dict(self, saved: dict | None, source: str) -> None:
        """What an earlier run found about its decay and the spike guard's history; else both start afresh (said).
        The phase itself is not restored: it is a function of the step (:meth:`after_load` applies it)."""
        if self.state.lr_decay is not None:
            got = (saved or {}).get("lr_decay")
            if got is None:
                log.warning("ds_nvfp4: %s holds no learning-rate history for bf16_from \"lr_decay\": the decay is "
                            "looked for again from this step on", source)
                self.state.lr_decay = LrDecay()
            else:
                self.state.lr_decay = LrDecay(**got)
                self.state.plan = replace(self.state.plan, first_late_step=self.state.lr_decay.found)
        if self.state.guard is not None:
            got = (saved or {}).get("spike_guard")
            cfg = self.state.guard.config
            if got is None:
                log.warning("ds_nvfp4: %s holds no spike-guard state: the guard starts afresh from this step (no "
                            "episodes, an empty loss history)", source)
                self.state.guard = SpikeGuard(cfg)
            else:
                self.state.guard = SpikeGuard.from_dict(cfg, got)

    def after_load(self, state: NVFP4State, load: LoadContext) -> None:
        self._to_next_step(state)

    def _watch_loss(self, state: NVFP4State, outcome: StepOutcome, ran: Phase) -> None:
        """``spike_guard``: the step's loss, pooled over the ranks (every rank calls this: one all-reduce)."""
        loss = mean_over_ranks(outcome.loss_sum, outcome.loss_count)
        if loss is None:
            if state.rank == 0 and not self._said_no_loss:  # once per engine, also in a resumed run
                self._said_no_loss = True
                log.warning("ds_nvfp4: precision.schedule.spike_guard sees no loss: engine.backward(loss) was not "
                            "called through this engine, so the guard can open NO episode")
            return
        guard = self.state.guard
        found = guard.observe(outcome.step, loss, ran_fp4=ran.any_fp4)
        cfg = guard.config
        if isinstance(found, Episode):
            if state.rank == 0:
                announce(f"ds_nvfp4: precision.schedule.spike_guard: step {found.detected_at} loss {found.loss:.4g} "
                         f"is {found.ratio:.2f}x the median {found.median:.4g} of the previous {cfg.window} steps "
                         f"(threshold {cfg.loss_ratio:g}x): steps {found.start}-{found.end} run every converted "
                         f"layer in BF16 (episode {len(guard.episodes)} of at most {cfg.max_episodes})")
            if self.engine.monitor.enabled:
                self.engine.monitor.write_events([
                    ("Train/Precision/spike_guard_episodes", float(len(guard.episodes)), outcome.step),
                    ("Train/Precision/spike_guard_ratio", found.ratio, outcome.step)])
        elif found is not None and state.rank == 0:
            log.warning("ds_nvfp4: precision.schedule.spike_guard: step %d loss %.4g is above %gx the median of the "
                        "previous %d steps, but all %d episodes (max_episodes) are spent: FP4 goes on",
                        found, loss, cfg.loss_ratio, cfg.window, cfg.max_episodes)

    def _watch_lr(self, state: NVFP4State, step: int) -> None:
        """``bf16_from: "lr_decay"``: feed the learning rate of step ``step``; fix the switch when decay starts."""
        found = self.state.lr_decay
        if found is None or found.done:
            return
        found.observe(step, float(self.engine.get_lr()[0]))
        if found.found is not None:
            self.state.plan = replace(self.state.plan, first_late_step=found.found)
            if state.rank == 0:
                announce(f"ds_nvfp4: precision.schedule.bf16_from \"lr_decay\": the learning rate falls from step "
                         f"{found.found} after {found.stable_steps} constant steps: the late switch starts there")
        elif found.no_plateau_at is not None and state.rank == 0:
            log.warning("ds_nvfp4: precision.schedule.bf16_from \"lr_decay\": the learning rate falls from step %d "
                        "without a constant stretch before it (a schedule that decays from its warm-up on, not a "
                        "warmup-stable-decay one): this run makes NO late BF16 switch; give bf16_from as a step "
                        "number or a fraction of precision.schedule.total_steps instead", found.no_plateau_at)
