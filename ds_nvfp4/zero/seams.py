"""Every DeepSpeed name ds_nvfp4 relies on beyond ``deepspeed.initialize``, declared once and checked at start-up.

DeepSpeed's engine and ZeRO-3 internals move between releases. :data:`SEAMS` lists each attribute, method and
closure signature that any part of ds_nvfp4 uses (the engine lifecycle, the packed ZeRO-3 storage, the checkpoint
and shared-memory helpers), with what uses it. :func:`check` runs at every enabled ``ds_nvfp4.initialize``,
before anything is changed: a DeepSpeed that lacks one fails at start-up with its name and the version, instead of
corrupting weights or silently skipping a feature mid-run. :func:`check_version` compares the installed release
with the tested range (an error for packed storage, which relies on the most internals; a warning otherwise).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

#: the DeepSpeed releases ds_nvfp4 was tested with (lower inclusive, upper exclusive)
TESTED_RANGE = (Version("0.19.8"), Version("0.20"))
#: environment variable that lets packed storage run on an untested DeepSpeed release (the seams are still checked)
ALLOW_UNTESTED_ENV = "DS_NVFP4_ALLOW_UNTESTED_DEEPSPEED"


class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed lacks a name ds_nvfp4 relies on (or is outside the tested range)."""


@dataclass(frozen=True)
class Targets:
    """The objects the seams are looked up on: the engine, its optimizer and one ZeRO-3 parameter (None when the
    run has none)."""

    engine: Any
    optimizer: Any = None
    param: Any = None


@dataclass(frozen=True)
class Seam:
    """One name DeepSpeed must provide.

    Attributes:
        name: how it reads in an error, e.g. ``"optimizer.fp32_partitioned_groups_flat"``.
        scope: ``"engine"`` (every enabled run), ``"packed"`` (ZeRO-3 with ``weights.storage: "nvfp4"``) or
            ``"pipeline"`` (a ``PipelineEngine``).
        used_by: the ds_nvfp4 file and what it does with it.
        find: returns the object (raises ``AttributeError`` / ``ImportError`` when it is missing).
        params: parameter names a callable must accept (the keywords ds_nvfp4 passes or wraps).
    """

    name: str
    scope: str
    used_by: str
    find: Callable[[Targets], Any]
    params: tuple[str, ...] = ()

    def missing(self, targets: Targets) -> str | None:
        """None when present (and callable with :attr:`params`), else what is wrong."""
        try:
            obj = self.find(targets)
        except (AttributeError, ImportError, KeyError, TypeError) as exc:
            return f"{self.name} is missing ({type(exc).__name__}: {exc})"
        if self.params:
            try:
                names = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                return f"{self.name} has no readable signature"
            lacking = [p for p in self.params if p not in names]
            if lacking and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in names.values()):
                return f"{self.name} does not take {', '.join(lacking)} (its signature: {inspect.signature(obj)})"
        return None


def _import(module: str, name: str) -> Callable[[Targets], Any]:
    def find(_t: Targets) -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)

    return find


def _attr(root: str, *path: str) -> Callable[[Targets], Any]:
    def find(t: Targets) -> Any:
        obj = getattr(t, root)
        if obj is None:
            raise AttributeError(f"no {root} to look it up on")
        for name in path:
            obj = getattr(obj, name)
        return obj

    return find


def _status(t: Targets) -> Any:
    status = _import("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus")(t)
    return status.NOT_AVAILABLE, status.INFLIGHT, status.AVAILABLE


_E, _P, _PIPE = "engine", "packed", "pipeline"
SEAMS: tuple[Seam, ...] = (
    # ---- the engine lifecycle (engine/lifecycle.py and its features), every enabled run
    Seam("deepspeed.utils.set_z3_leaf_module", _E, "zero/leaves.py: experts modules become ZeRO-3 leaf modules",
         _import("deepspeed.utils", "set_z3_leaf_module"), ("model", "flag")),
    Seam("deepspeed.utils.z3_leaf_module", _E, "zero/leaves.py: modules DeepSpeed's leaf_module config flagged already",
         _import("deepspeed.utils", "z3_leaf_module"), ("model",)),
    Seam("engine.global_steps", _E, "engine/lifecycle.py: an optimizer step happened (applied or skipped) when it "
         "moves", _attr("engine", "global_steps")),
    Seam("engine.skipped_steps", _E, "engine/nonfinite.py: the step was skipped for NaN/Inf gradients",
         _attr("engine", "skipped_steps")),
    Seam("engine.global_samples", _E, "engine/statistics.py: the x-axis of DeepSpeed's Train/Samples events",
         _attr("engine", "global_samples")),
    Seam("engine.monitor.write_events", _E, "engine features: precision events in DeepSpeed's monitor",
         _attr("engine", "monitor", "write_events")),
    Seam("engine.checkpoint_engine.is_decoupled", _E, "engine/checkpoint.py: a decoupled (async) checkpoint engine "
         "writes `latest` itself", _attr("engine", "checkpoint_engine", "is_decoupled")),
    Seam("engine.save_checkpoint", _E, "engine/lifecycle.py wraps it (metadata, RNG state, atomic `latest`)",
         _attr("engine", "save_checkpoint"), ("save_dir", "tag", "client_state", "save_latest",
                                               "exclude_frozen_parameters")),
    Seam("engine.load_checkpoint", _E, "engine/lifecycle.py wraps it (RNG state, weight codes, schedule)",
         _attr("engine", "load_checkpoint"), ("load_dir", "tag")),
    Seam("engine.step", _E, "engine/lifecycle.py: the step DeepSpeedEngine users call", _attr("engine", "step")),
    Seam("deepspeed.comm.comm.cdb", _E, "zero/shm.py: unlinks the CPU shared-memory all-reduce segments",
         _import("deepspeed.comm.comm", "cdb")),
    # ---- PipelineEngine: train_batch is its step
    Seam("engine.train_batch", _PIPE, "engine/lifecycle.py: the step a PipelineEngine runs",
         _attr("engine", "train_batch"), ("data_iter",)),
    Seam("engine.module._layer_specs", _PIPE, "engine/pipeline.py: the blocks precision.modules counts",
         _attr("engine", "module", "_layer_specs")),
    Seam("engine.stage_id / num_stages / grid.get_data_parallel_rank", _PIPE, "engine/pipeline.py: which stage "
         "a rank's report shows, and which rank of the stage shows it",
         lambda t: (t.engine.stage_id, t.engine.num_stages, t.engine.grid.get_data_parallel_rank)),
    # ---- packed ZeRO-3 storage (zero/packed.py, zero/gather.py, zero/optimizer.py)
    Seam("optimizer._reassign_or_swap_out_partitioned_parameters", _P, "zero/optimizer.py: re-packs a sub-group "
         "from its FP32 master after each step", _attr("optimizer", "_reassign_or_swap_out_partitioned_parameters"),
         ("sub_group_id",)),
    Seam("optimizer.load_state_dict", _P, "zero/optimizer.py: loads into DeepSpeed's flat layout, then re-packs",
         _attr("optimizer", "load_state_dict")),
    Seam("optimizer._restore_from_bit16_weights", _P, "zero/optimizer.py: same, for 16-bit weight restores",
         _attr("optimizer", "_restore_from_bit16_weights")),
    Seam("optimizer.load_module_checkpoint_state_from_checkpoint_dir_stage3", _P, "zero/optimizer.py: same, for "
         "universal checkpoints", _attr("optimizer", "load_module_checkpoint_state_from_checkpoint_dir_stage3"),
         ("checkpoint_dir", "load_from_fp32_weights")),
    Seam("optimizer._partition_all_parameters", _P, "zero/optimizer.py: releases every gathered weight before "
         "packing", _attr("optimizer", "_partition_all_parameters")),
    Seam("optimizer.fp16_groups", _P, "zero/packed.py: the parameters of each optimizer sub-group",
         _attr("optimizer", "fp16_groups")),
    Seam("optimizer.fp16_partitioned_groups_flat", _P, "zero/packed.py: DeepSpeed's flat BF16 partitions (replaced)",
         _attr("optimizer", "fp16_partitioned_groups_flat")),
    Seam("optimizer.fp32_partitioned_groups_flat", _P, "zero/packed.py: the FP32 masters packed after each step",
         _attr("optimizer", "fp32_partitioned_groups_flat")),
    Seam("optimizer.sub_group_process_groups", _P, "zero/packed.py: the group that agrees on each amax",
         _attr("optimizer", "sub_group_process_groups")),
    Seam("optimizer.persistent_parameters", _P, "zero/packed.py: small always-gathered weights re-gathered after "
         "packing", _attr("optimizer", "persistent_parameters")),
    Seam("parameter.ds_tensor", _P, "zero/packed.py: the partition whose .data becomes packed",
         _attr("param", "ds_tensor")),
    Seam("parameter.ds_numel / ds_shape / ds_id / ds_status", _P, "zero/packed.py, zero/gather.py: shapes, the "
         "gather order, the gather state", lambda t: (t.param.ds_numel, t.param.ds_shape, t.param.ds_id,
                                                       t.param.ds_status)),
    Seam("parameter.ds_process_group", _P, "zero/gather.py: the group packed partitions are gathered in",
         _attr("param", "ds_process_group")),
    Seam("parameter.partition_numel", _P, "zero/packed.py: the partition length (padding included)",
         _attr("param", "partition_numel")),
    Seam("parameter.all_gather", _P, "zero/gather.py wraps it (dequantize or gather codes)",
         _attr("param", "all_gather"), ("param_list", "async_op", "hierarchy")),
    Seam("parameter.all_gather_coalesced", _P, "zero/gather.py wraps it", _attr("param", "all_gather_coalesced"),
         ("params", "safe_mode", "quantize")),
    Seam("parameter.partition", _P, "zero/gather.py wraps it (release; re-pack after GatheredParameters edits)",
         _attr("param", "partition"), ("param_list", "hierarchy", "has_been_updated", "free_data")),
    Seam("ZeroParamStatus.NOT_AVAILABLE / INFLIGHT / AVAILABLE", _P, "zero/gather.py: gather states",
         _status),
)


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def check_version(packed: bool, allow_untested: bool = False) -> str | None:
    """A warning text for a release outside :data:`TESTED_RANGE` (None inside it). With ``packed`` (the most
    internals) outside the range raises :class:`UnsupportedDeepSpeed` unless ``allow_untested``."""
    v = Version(deepspeed_version().split("+")[0])
    lo, hi = TESTED_RANGE
    if lo <= v < hi:
        return None
    msg = (f"DeepSpeed {v} is outside the range ds_nvfp4 was tested with ({lo} <= v < {hi}); every DeepSpeed "
           "name it uses was checked and is present, but behaviour may differ")
    if packed and not allow_untested:
        raise UnsupportedDeepSpeed(msg + f"; set {ALLOW_UNTESTED_ENV}=1 to try packed ZeRO-3 storage anyway, or use "
                                         'precision.weights.storage: "bf16"')
    return msg


def check(targets: Targets, scopes: tuple[str, ...]) -> None:
    """Raise :class:`UnsupportedDeepSpeed` naming every seam of ``scopes`` that ``targets`` lack."""
    problems = [(s, why) for s in SEAMS if s.scope in scopes for why in [s.missing(targets)] if why]
    if problems:
        lines = "\n  ".join(f"{why} (used by {s.used_by})" for s, why in problems)
        lo, hi = TESTED_RANGE
        hint = ('; use precision.weights.storage: "bf16"' if any(s.scope == _P for s, _ in problems) else "")
        raise UnsupportedDeepSpeed(f"DeepSpeed {deepspeed_version()} lacks what ds_nvfp4 relies on (tested with "
                                   f"{lo} <= v < {hi}){hint}:\n  {lines}")
