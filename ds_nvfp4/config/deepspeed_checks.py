"""Check the DeepSpeed part of a ds_config with DeepSpeed's own config models, without a process group.

How far this goes: ``zero_optimization`` (DeepSpeedZeroConfig, including offload sub-sections), the monitor
sections (TensorBoard/W&B/CSV/Comet models) are validated field by field, so errors carry their JSON path;
then the whole dict goes through ``DeepSpeedConfig`` as ``deepspeed.initialize`` would parse it for one rank
(batch-size arithmetic that depends on the world size is left to ``initialize``). DeepSpeed still ignores
unknown top-level keys; checks.top_level_warnings covers near-misses.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from typing import Any

from .problems import Problem


@contextlib.contextmanager
def _quiet_deepspeed():
    """DeepSpeed logs its accelerator choice on import; validation output must stay clean."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if _has_cuda() else "cpu")
    logger = logging.getLogger("DeepSpeed")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _pydantic_errors(prefix: str, exc: Exception) -> list[Problem]:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return [Problem(prefix, str(exc))]
    out = []
    for e in errors():
        loc = ".".join(str(x) for x in e.get("loc", ()))
        out.append(Problem(f"{prefix}.{loc}" if loc else prefix, f"{e.get('msg')} (DeepSpeed's own check)"))
    return out


def deepspeed_problems(ds: dict[str, Any]) -> list[Problem]:
    """Problems DeepSpeed itself would raise for this dict (as errors), or a warning if it cannot run."""
    try:
        with _quiet_deepspeed():
            from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
            from deepspeed.runtime.config import DeepSpeedConfig
            from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except Exception as exc:  # not installed, or broken install: say so, do not pretend it was checked
        return [Problem("(deepspeed)", f"DeepSpeed could not be imported ({exc}); the DeepSpeed part of the file was "
                                       "not checked", severity="warning")]
    out: list[Problem] = []
    sections = {"zero_optimization": DeepSpeedZeroConfig, "tensorboard": TensorBoardConfig, "wandb": WandbConfig,
                "csv_monitor": CSVConfig, "comet": CometConfig}
    for key, model in sections.items():
        if key not in ds:
            continue
        if not isinstance(ds[key], dict):
            out.append(Problem(key, "expected a JSON object"))
            continue
        try:
            with _quiet_deepspeed():
                model(**ds[key])
        except Exception as exc:
            out += _pydantic_errors(key, exc)
    if out:
        return out
    whole = copy.deepcopy(ds)
    if "train_micro_batch_size_per_gpu" in whole:
        whole.pop("train_batch_size", None)  # depends on the world size, checked by initialize
    try:
        with _quiet_deepspeed():
            DeepSpeedConfig(whole)
    except Exception as exc:
        out.append(Problem("(deepspeed)", f"DeepSpeedConfig rejects the file: {type(exc).__name__}: {exc}"))
    return out
