"""The engine layer: ``initialize`` and the lifecycle that attaches ds_nvfp4 to a DeepSpeed engine.

``initialize.py`` (the entry point) <- ``lifecycle.py`` (the mixin, the ordered features, their hooks) and one file
per feature: ``weight_cache.py``, ``nonfinite.py``, ``statistics.py``, ``schedule.py``, ``checkpoint.py``.
"""

from .initialize import initialize, storage_report
from .lifecycle import Feature, Lifecycle, LoadContext, SaveContext, StepOutcome
from .state import NVFP4State

__all__ = ["Feature", "Lifecycle", "LoadContext", "NVFP4State", "SaveContext", "StepOutcome", "initialize",
           "storage_report"]
