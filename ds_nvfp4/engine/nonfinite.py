"""Feature ``nonfinite`` (``precision.nonfinite``): act on the steps DeepSpeed skips for NaN/Inf gradients.

DeepSpeed's BF16 optimizers (every ZeRO stage, ``bf16.check_grad_overflow`` true) already test the gradient norm,
agree on the result across ranks, skip the step (masters and optimizer state untouched) and count it in
``engine.skipped_steps``. This feature reads that counter (no second pass over the gradients) and raises
:class:`~ds_nvfp4.nn.NonFiniteError` on every rank, or counts, reports and bounds the skips, naming the first FP4
layers whose forward saw a non-finite input or output. The counts are saved with each checkpoint
(:meth:`NonFiniteGuard.state_dict`): a resumed run keeps counting, and ``max_consecutive_skips`` spans the resume.
"""

from __future__ import annotations

import logging

from ..nn import NonFiniteError, nonfinite_layers
from .lifecycle import Feature, StepOutcome
from .state import NVFP4State

log = logging.getLogger("ds_nvfp4")


class NonFiniteGuard(Feature):
    name = "nonfinite"

    def __init__(self, engine) -> None:
        self.engine = engine
        #: optimizer steps skipped so far, and in a row
        self.skipped = 0
        self.consecutive = 0

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, saved: dict | None, source: str) -> None:
        # a checkpoint without the counts (older, or plain DeepSpeed) restarts them: nothing to warn about, the
        # counts only bound future skips
        self.skipped = int((saved or {}).get("skipped", 0))
        self.consecutive = int((saved or {}).get("consecutive", 0))

    def after_step(self, state: NVFP4State, outcome: StepOutcome) -> None:
        cfg = state.precision.nonfinite
        culprits = nonfinite_layers(self.engine.module, read=outcome.skipped)  # flags reset every optimizer step
        if not outcome.skipped:
            self.consecutive = 0
            return
        self.skipped += 1
        self.consecutive += 1
        where = (f"first FP4 layers with a non-finite input or output on this rank: {', '.join(culprits[:4])}"
                 if culprits else "no FP4 layer saw a non-finite forward input or output on this rank: the values "
                                  "arose in the backward, the loss or a BF16 layer")
        what = (f"ds_nvfp4: step {outcome.step}: gradients hold NaN/Inf (DeepSpeed's gradient-norm check); {where}; "
                "the FP32 masters and optimizer state are unchanged")
        if cfg.action == "raise":
            raise NonFiniteError(what + ' (precision.nonfinite.action: "raise")')
        if self.consecutive > cfg.max_consecutive_skips:
            raise NonFiniteError(f"{what}; {self.consecutive} steps in a row were skipped, more than "
                                 f"precision.nonfinite.max_consecutive_skips ({cfg.max_consecutive_skips})")
        if state.rank == 0:  # WARNING reaches stderr even where the script configured no logging (last resort)
            log.warning("%s; skipped (%d skipped so far, %d in a row)", what, self.skipped, self.consecutive)
        if self.engine.monitor.enabled:
            self.engine.monitor.write_events([("Train/Precision/skipped_steps", self.skipped,
                                               self.engine.global_samples)])
