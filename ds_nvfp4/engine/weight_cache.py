"""Feature ``weight_cache``: quantize each FP4 weight once per optimizer step under ZeRO-0/1/2.

The step's other forwards (gradient accumulation, activation-checkpointing recomputation, evaluation) reuse its
codes (``WeightCodes.cache``); after every optimizer step and checkpoint load the codes are dropped. Not under
ZeRO-3: there the full weight exists only while gathered, and keeping every layer's codes would hold 0.28x of the
whole model on each rank (with ``all_gather: "nvfp4"`` the gathered codes are used instead).
``DS_NVFP4_WEIGHT_CACHE=0`` turns it off (the codes are the same either way; tested).
"""

from __future__ import annotations

import os

from .lifecycle import Feature, LoadContext, StepOutcome
from .state import NVFP4State

ENV = "DS_NVFP4_WEIGHT_CACHE"


class WeightCache(Feature):
    name = "weight_cache"

    def __init__(self, state: NVFP4State, layers: list) -> None:
        self.codes = [codes for m in layers for _, _, codes in m.fp4_weights()]
        self.enabled = state.stage < 3 and os.environ.get(ENV, "1").strip() != "0"
        for c in self.codes:
            c.cache = self.enabled
        state.conversion.notes.append(self._note(state))

    def _note(self, state: NVFP4State) -> str:
        if self.enabled:
            return "weight quantization: once per optimizer step, reused by the step's other forwards"
        if state.stage >= 3 and state.store is not None and state.precision.communication.all_gather == "nvfp4":
            return ("weight quantization: none for weights stored packed (the forward uses the NVFP4 codes as "
                    "gathered, all_gather \"nvfp4\"), every forward for the others")
        if state.stage >= 3:
            return ("weight quantization: every forward (ZeRO-3 gathers weights per forward; all_gather \"nvfp4\" "
                    "would hand the forward the stored codes instead)")
        return f"weight quantization: every forward ({ENV}=0)"

    def invalidate(self) -> None:
        for c in self.codes:
            c.invalidate()

    def after_step(self, state: NVFP4State, outcome: StepOutcome) -> None:
        self.invalidate()  # the optimizer changed the weights through its flat buffers (a skipped step did not,
        # but DeepSpeed may still have rewritten them from the masters: quantizing again is the safe side)

    def after_load(self, state: NVFP4State, load: LoadContext) -> None:
        self.invalidate()
