"""`ds_nvfp4.initialize`: ``deepspeed.initialize`` with NVFP4 (a one-line change in a training script).

Reads the ``precision`` section from the same ds_config (a path, a dict, or ``args.deepspeed_config``), validates
it, converts the model's GEMM layers, calls ``deepspeed.initialize`` unchanged, checks every DeepSpeed name ds_nvfp4
relies on (zero/seams.py), packs the ZeRO-3 weight partitions (``weights.storage: "nvfp4"``) and installs the
engine lifecycle (lifecycle.py) with its features in their one order. With ``precision.enabled`` false or absent it
*is* ``deepspeed.initialize``: same arguments, same return tuple; the two things added in both cases are process
hygiene: unlinking DeepSpeed's CPU shared-memory all-reduce segments once every rank has mapped them (zero/shm.py),
and destroying gloo process groups at interpreter exit, which otherwise aborts a finished run now and then
(zero/teardown.py).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os

import ds_nvfp4_autohook as autohook

from ..config import ConfigError, PrecisionConfig, Problem, load_config
from ..config.schedule import SchedulePlan
from ..kernels import read_device, select
from ..nn import ConversionReport, convert_model
from ..nn.module import FP4Module
from ..zero import seams
from ..zero.leaves import mark_experts_leaves
from ..zero.shm import release_shm_workspace
from ..zero.teardown import destroy_at_exit
from ..zero.traffic import engine_traffic
from .announce import announce, summary_line
from .base import finish_base, open_base, prepare_base
from .checkpoint import Checkpoints
from .lifecycle import Feature, install, is_pipeline
from .nonfinite import NonFiniteGuard
from .pipeline import pipeline_blocks, stage_note
from .schedule import Schedule
from .state import NVFP4State
from .statistics import Statistics
from .weight_cache import WeightCache

log = logging.getLogger("ds_nvfp4")


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize`` (same signature and return tuple).

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; ``engine.ds_nvfp4`` holds the
    :class:`NVFP4State` (conversion report, kernel selection, storage, lifecycle) when NVFP4 is enabled.

    Raises:
        ConfigError: the ``precision`` section (or its cross-checks) is invalid; nothing was started.
        kernels.BackendUnavailable: ``precision.kernel`` cannot run here.
        zero.UnsupportedDeepSpeed: the installed DeepSpeed lacks a name ds_nvfp4 relies on.
    """
    import deepspeed

    # DeepSpeed's own function, also when the start-up hook wrapped deepspeed.initialize (which calls us)
    deepspeed_initialize = autohook.original_initialize(deepspeed)
    bound = inspect.signature(deepspeed_initialize).bind(*args, **kwargs)
    where, source = autohook.config_source(bound.arguments)
    if where is None:
        raise ConfigError([Problem("(config)", "no ds_config given: pass config=..., config_params=... or "
                                               "args.deepspeed_config")])
    ds_config, precision = load_config(source)
    if not precision.enabled:
        if autohook.SECTION not in ds_config:
            autohook.warn_near_miss(ds_config)
        result = deepspeed_initialize(*args, **kwargs)
        _process_hygiene()
        return result

    ds_config = _effective_ds_config(ds_config, precision)
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    packed = stage == 3 and precision.stored_packed(stage)
    warning = seams.check_version(packed, os.environ.get(seams.ALLOW_UNTESTED_ENV) == "1")
    if warning:
        log.warning("ds_nvfp4: %s", warning)

    model = bound.arguments.get("model")
    if model is None:
        raise ValueError("ds_nvfp4.initialize needs model=... (the module to convert)")
    selection = select(precision.kernel)
    base = open_base(model, precision)  # a checkpoint is validated before anything changes
    conversion = convert_model(model, precision, selection=selection, blocks=pipeline_blocks(model),
                               bf16_reasons=base.bf16_reasons if base else None)
    _refuse_nothing_fp4(conversion, model)
    if base is not None:
        prepare_base(model, base, precision, conversion)
    if stage == 3 and (leaves := mark_experts_leaves(model)):
        conversion.notes.append(f"ZeRO-3: {len(leaves)} experts modules made leaf modules (their per-expert loop "
                                "runs submodules a data-dependent number of times, which ZeRO-3's prefetch trace "
                                "cannot follow; zero/leaves.py)")
    if stage == 3 and not packed:
        _unfuse(model, conversion, conversion.fused_groups, "ZeRO-3 with weights.storage \"bf16\" gathers one "
                                                            "layer at a time, so no forward sees its peers' weights")
    if where == "args":
        # DeepSpeed refuses a config given both ways: hand it the validated dict, and a copy of args without it
        args_copy = copy.copy(bound.arguments["args"])
        args_copy.deepspeed_config = None
        bound.arguments["args"] = args_copy
        bound.arguments["config"] = ds_config
    else:
        bound.arguments[where] = ds_config
    engine, optimizer, loader, scheduler = deepspeed_initialize(*bound.args, **bound.kwargs)
    _process_hygiene()

    import deepspeed.comm as dist

    state = NVFP4State(precision, selection, conversion, ds_config=ds_config, stage=stage,
                       rank=dist.get_rank() if dist.is_initialized() else 0,
                       world_size=dist.get_world_size() if dist.is_initialized() else 1)
    layers = [m for m in engine.module.modules() if isinstance(m, FP4Module)]
    converted = {id(p): codes for m in layers for _, p, codes in m.fp4_weights()}
    scopes = ("engine",) + (("pipeline",) if is_pipeline(engine) else ()) + (("packed",) if packed else ())
    sample = next((p for p in engine.module.parameters() if id(p) in converted), None)
    seams.check(seams.Targets(engine, engine.optimizer, sample), scopes)  # before anything is changed
    state.seam_scopes = scopes
    if is_pipeline(engine):
        conversion.notes.append(stage_note(engine))
    if selection.name == "emulated" and read_device().device_type == "cpu":
        from ..kernels.cpu_allocator import allocator_note

        if (note := allocator_note()) is not None:
            conversion.notes.append(note)
    if packed:
        from ..zero import install as install_storage

        names = {id(p): n for n, p in engine.module.named_parameters()}
        fused = [[id(engine.module.get_submodule(n).weight) for n in g] for g in conversion.fused_groups]
        state.store = install_storage(engine, names, converted, layers[0].recipe,
                                      precision.communication.all_gather, fused,
                                      base.sources if base else None, base.describe_sources() if base else "")
        for name, why in state.store.kept_bf16.items():
            conversion.notes.append(f"{name}: FP4 GEMMs, but its ZeRO-3 partition is stored BF16: {why}")
        for label, why in state.store.unfused.items():
            _unfuse(engine.module, conversion, [label.split(", ")], why)
    if base is not None:
        finish_base(base, engine, state.store)
    schedule = Schedule(engine, state, SchedulePlan.from_config(precision, ds_config), layers)
    state.schedule_feature, state.nonfinite_feature = schedule, NonFiniteGuard(engine)
    if precision.monitor.enabled:
        state.statistics_feature = Statistics(engine, precision.monitor.interval)
    # THE ORDER of the features (docs/architecture.md, engine/lifecycle.py): every hook runs them in this order
    features: list[Feature] = [Checkpoints(engine), WeightCache(state, layers), state.nonfinite_feature,
                               *([state.statistics_feature] if state.statistics_feature is not None else []), schedule]
    install(engine, state, features)
    schedule.start(state)
    if state.rank == 0 or (is_pipeline(engine) and engine.grid.get_data_parallel_rank() == 0):
        report = state.store.report() if state.store is not None else None
        announce(summary_line(state, report) + "\n" + conversion.table()
                 + (f"\n{report.summary()}" if report is not None else "")
                 + (f"\nds_nvfp4 ZeRO-3 traffic per optimizer step and rank: {engine_traffic(engine).describe()}"
                    if state.stage == 3 else ""))
    return engine, optimizer, loader, scheduler


def _process_hygiene() -> None:
    """What ``initialize`` adds after ``deepspeed.initialize`` whether NVFP4 is on or not (collective: every rank)."""
    release_shm_workspace()
    destroy_at_exit()


def _refuse_nothing_fp4(conversion: ConversionReport, model) -> None:
    """``precision.enabled`` with no GEMM in FP4 would print "NVFP4 ON" over a BF16 run: stop, saying what was found
    and why each GEMM stayed BF16."""
    if conversion.converted:
        return
    found = [f"{d.name} ({d.kind}): {d.reason}" for d in conversion.layers][:12]
    more = f" (and {len(conversion.layers) - 12} more)" if len(conversion.layers) > 12 else ""
    what = "; ".join(found) + more if found else (f"no GEMM module at all in {type(model).__name__} (ds_nvfp4 converts "
                                                   "nn.Linear, Conv1D and MoE experts)")
    raise ConfigError([Problem("precision.enabled", "true, but no GEMM of the model would run in FP4, so the run "
                                                    f"would be plain BF16: {what}. Adjust precision.modules "
                                                    "(include/exclude/overrides, the block rules) or set "
                                                    "precision.enabled: false")])


def _effective_ds_config(ds_config: dict, precision: PrecisionConfig) -> dict:
    """The dict DeepSpeed receives: a copy, with the gradient reduce-scatter dtype the section asks for."""
    ds_config = copy.deepcopy(ds_config)
    if precision.communication.reduce_scatter == "fp32":
        ds_config.setdefault("communication_data_type", "fp32")
    return ds_config


def _unfuse(model, conversion: ConversionReport, groups: list[list[str]], why: str) -> None:
    """Groups that cannot share an amax here: each member quantizes with its own (said in the report)."""
    for names in list(groups):
        for n in names:
            model.get_submodule(n).weight_codes.group = None
        if names in conversion.fused_groups:
            conversion.fused_groups.remove(names)
        conversion.notes.append(f"fused group {', '.join(names)} does not share an amax: {why}; an NVFP4 export "
                                "re-quantizes it with one global scale (and says so)")


def storage_report(engine):
    """Per-rank :class:`zero.StorageReport` of an engine from ``ds_nvfp4.initialize`` (None without packed storage)."""
    state = getattr(engine, "ds_nvfp4", None)
    return state.store.report() if state is not None and state.store is not None else None
