"""``precision.schedule`` as a plan: which GEMMs run in FP4 at which optimizer step (pure: no torch, no engine).

The engine applies it (engine/schedule.py) after every optimizer step and checkpoint load; ``explain`` and the
config rules read it too.

Three phases (steps counted from 1, like DeepSpeed's ``global_steps`` after a step):

* ``warmup`` (steps 1 .. ``bf16_warmup_steps``): every converted layer runs ``nn.Linear``'s BF16 forward and
  backward; with packed ZeRO-3 storage the partitions are DeepSpeed's BF16 ones (copied from the FP32 masters).
* ``fp4``: the recipe as configured; packed partitions re-derived from the FP32 masters at the transition.
* ``late`` (from ``bf16_from`` on, to the end): the GEMMs named by ``bf16_gemms`` in BF16. ``bf16_from:
  "lr_decay"`` leaves the step open until the run's learning rate starts to fall after a constant stretch (the
  decay of a warmup-stable-decay schedule, where NVIDIA's 12B run switched): engine/schedule.py finds it at run time
  and saves it with each checkpoint. When the forward turns
  BF16 the weights do too (the paper's switch: BF16 GEMMs on BF16 weights, not on dequantized FP4 ones), so packed
  storage goes back to DeepSpeed's BF16 partitions.

``spike_guard`` adds a fourth phase, ``guard``: after a step whose loss jumps (engine/spike_guard.py), the next
``bf16_steps`` steps run like the warm-up (every converted layer BF16, BF16 weights) wherever the plan had FP4. The
episodes found so far are saved with each checkpoint, so a resumed run repeats them.

Apart from those episodes the phase depends on the step number only, so a run resumed from a checkpoint on either
side of a switch takes the same phase at the same step as the uninterrupted run (``engine.load_checkpoint``
re-applies it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .schema import PrecisionConfig, SpikeGuardConfig


@dataclass(frozen=True)
class Phase:
    """What one optimizer step runs: FP4 Fprop, FP4 Dgrad/Wgrad (as far as the recipe has them), packed weights."""

    name: str              # "warmup", "fp4" or "late"
    forward_fp4: bool
    backward_fp4: bool
    packed: bool           # weight partitions stored NVFP4 (when the config stores them packed at all)

    def describe(self) -> str:
        gemms = [g for g, on in (("Fprop", self.forward_fp4), ("Dgrad/Wgrad", self.backward_fp4)) if on]
        return f"{self.name}: " + (f"FP4 {' and '.join(gemms)}" if gemms else "every converted layer in BF16")

    @property
    def any_fp4(self) -> bool:
        return self.forward_fp4 or self.backward_fp4


#: a spike-guard episode: what the warm-up runs (every converted layer BF16, BF16 weights)
GUARD = Phase("guard", False, False, False)


@dataclass(frozen=True)
class SchedulePlan:
    """The phases of a run as a function of the step number (pure: no engine, no torch)."""

    warmup_steps: int
    first_late_step: int | None
    late_gemms: str            # "forward", "backward" or "all"
    recipe_backward_fp4: bool  # backward.gemm == "nvfp4"
    at_lr_decay: bool = False  # bf16_from "lr_decay": first_late_step is found at run time
    guard: SpikeGuardConfig | None = None  # spike_guard: episodes found at run time

    @classmethod
    def from_config(cls, precision: PrecisionConfig, ds_config: dict) -> SchedulePlan:
        sc = precision.schedule
        return cls(sc.bf16_warmup_steps, first_late_bf16_step(ds_config, precision), sc.bf16_gemms,
                   precision.backward.gemm == "nvfp4", at_lr_decay=sc.bf16_from == "lr_decay", guard=sc.spike_guard)

    @property
    def active(self) -> bool:
        return (self.warmup_steps > 0 or self.first_late_step is not None or self.at_lr_decay
                or self.guard is not None)

    def phase(self, step: int) -> Phase:
        """The phase of optimizer step ``step`` (from 1)."""
        if step <= self.warmup_steps:
            return Phase("warmup", False, False, False)
        if self.first_late_step is not None and step >= self.first_late_step:
            return self._late()
        return Phase("fp4", True, self.recipe_backward_fp4, True)

    def _late(self) -> Phase:
        fwd = self.late_gemms == "backward"
        bwd = self.recipe_backward_fp4 and self.late_gemms == "forward"
        return Phase("late", fwd, bwd, fwd)

    def fp4_share(self, steps: int, fp4_weight_params: int, linear_weight_params: int,
                  phase: Callable[[int], Phase] | None = None) -> float:
        """The fraction of all Linear GEMM FLOPs of ``steps`` optimizer steps that ran in FP4. A layer's three GEMMs
        (Fprop, Dgrad, Wgrad) each cost ~``2 tokens in out`` FLOPs, so the FP4 share weighs each GEMM kind by the
        converted layers' weight elements against every Linear's (kept BF16 layers and the LM head included).
        ``phase``: the phase of each step as it ran (spike-guard episodes included), default the plan's."""
        if steps <= 0 or linear_weight_params <= 0:
            return 0.0
        phases = map(phase or self.phase, range(1, steps + 1))
        fp4_gemms = sum(p.forward_fp4 + 2 * p.backward_fp4 for p in phases)
        return fp4_gemms * fp4_weight_params / (3 * steps * linear_weight_params)

    def describe(self) -> list[str]:
        out = []
        if self.warmup_steps:
            out.append(f"steps 1-{self.warmup_steps}: every converted layer in BF16 (BF16 weights)")
        start = self.warmup_steps + 1
        end = f"-{self.first_late_step - 1}" if self.first_late_step is not None else " on"
        out.append(f"steps {start}{end}: {self.phase(start).describe()}")
        if self.at_lr_decay and self.first_late_step is None:
            out.append(f"from the first step of learning-rate decay (found at run time): {self._late().describe()}")
        elif self.first_late_step is not None:
            late = self.phase(self.first_late_step)
            out.append(f"steps {self.first_late_step} on: {late.describe()}"
                       + ("" if late.packed else " (BF16 weights)"))
        if self.guard is not None:
            g = self.guard
            out.append(f"spike guard: after a step whose loss exceeds {g.loss_ratio:g}x the median of the previous "
                       f"{g.window} steps, the next {g.bf16_steps} steps run every converted layer in BF16 (BF16 "
                       f"weights), at most {g.max_episodes} times")
        return out



def get_path(ds: dict, dotted: str, default: Any = None) -> Any:
    """``ds["a"]["b"]`` for ``"a.b"``, or ``default`` where a key is missing (JSON paths of a ds_config)."""
    node: Any = ds
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return default
        node = node[k]
    return node


def schedule_total_steps(ds: dict, pc: PrecisionConfig) -> int | None:
    """The run's optimizer steps for a fractional switch: the schedule's own, else DeepSpeed's scheduler's."""
    if pc.schedule.total_steps is not None:
        return pc.schedule.total_steps
    total = get_path(ds, "scheduler.params.total_num_steps")
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 1 else None


def first_late_bf16_step(ds: dict, pc: PrecisionConfig) -> int | None:
    """The first optimizer step (from 1) of the late BF16 switch, or None. A fraction ``f`` of ``T`` steps runs
    steps ``floor(f T) + 1 .. T`` in BF16 (0.85 of 2,100: steps 1,786-2,100, the last 15%)."""
    at = pc.schedule.bf16_from
    if at is None or isinstance(at, (bool, str)):  # "lr_decay": found at run time (engine/schedule.py)
        return None
    if isinstance(at, int):
        return at if at >= 1 else None
    total = schedule_total_steps(ds, pc)
    return int(at * total + 1e-9) + 1 if total is not None and 0.0 < at < 1.0 else None
