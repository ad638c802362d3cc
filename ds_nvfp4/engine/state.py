"""`NVFP4State`: what ``ds_nvfp4.initialize`` did to an engine, attached as ``engine.ds_nvfp4``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import PrecisionConfig
from ..kernels import Selection
from ..nn import ConversionReport

if TYPE_CHECKING:
    from ..nn import StatsCollector
    from .lifecycle import Lifecycle
    from .nonfinite import NonFiniteGuard
    from .schedule import Schedule, ScheduleState
    from .statistics import Statistics


@dataclass
class NVFP4State:
    """The run's precision, kernel choice, conversion report, packed storage and lifecycle (its features)."""

    precision: PrecisionConfig
    selection: Selection
    conversion: ConversionReport
    #: the resolved ds_config DeepSpeed received (``communication_data_type`` set from the precision section)
    ds_config: dict = field(default_factory=dict)
    #: ZeRO stage of the run
    stage: int = 0
    #: zero.PackedPartitions when ZeRO-3 weights are stored packed
    store: Any = None
    lifecycle: Lifecycle | None = None
    #: this process's data-parallel rank and the world size (from deepspeed.comm, the one source)
    rank: int = 0
    world_size: int = 1
    #: the seam scopes checked at initialize (zero/seams.py): "engine", plus "pipeline" and "packed" where they apply
    seam_scopes: tuple[str, ...] = ()
    #: the features others read, as typed references (set by initialize; statistics only with precision.monitor)
    schedule_feature: Schedule | None = None
    nonfinite_feature: NonFiniteGuard | None = None
    statistics_feature: Statistics | None = None

    # -- views of the features (kept as the attributes earlier releases had) -------------------------------------
    @property
    def stats(self) -> StatsCollector | None:
        """The statistics collector (``precision.monitor.enabled``), or None."""
        return self.statistics_feature.collector if self.statistics_feature is not None else None

    @property
    def schedule(self) -> ScheduleState:
        """``precision.schedule`` as it runs: the current phase and the transitions so far."""
        return self.schedule_feature.state

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients (``precision.nonfinite.action: "skip"``)."""
        return self.nonfinite_feature.skipped

    def fp4_gemm_share(self, steps: int) -> float:
        """Fraction of the GEMM FLOPs of optimizer steps 1..``steps`` that run in FP4 (schedule and spike-guard
        episodes so far included)."""
        layers = self.conversion.layers
        sched = self.schedule
        return sched.plan.fp4_share(steps, sum(d.params for d in layers if d.fp4), sum(d.params for d in layers),
                                    phase=sched.phase)
