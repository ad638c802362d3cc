"""Validation of the ``precision`` section and its cross-checks with the rest of the ds_config."""

from __future__ import annotations

import copy
import difflib
import itertools
from typing import Any

from pydantic import ValidationError

from .deepspeed_keys import DEEPSPEED_TOP_LEVEL_KEYS
from .problems import Problem
from .schedule import first_late_bf16_step, get_path, schedule_total_steps
from .schema import PrecisionConfig
from .schema_errors import SECTION, _auto_locs, _find_auto, _json_path, _pydantic_problem, _show


def validate_section(section: Any) -> tuple[PrecisionConfig | None, list[Problem]]:
    """Validate the raw ``precision`` value; returns the model (None when invalid) and the problems."""
    if not isinstance(section, dict):
        return None, [Problem(SECTION, f"expected a JSON object, got {_show(section)}")]
    problems = _find_auto(section)  # reported with every other schema error, once per "auto" value
    autos = {p.path for p in problems}
    try:
        model = PrecisionConfig.model_validate(section)
    except ValidationError as exc:
        found = [q for q in map(_pydantic_problem, exc.errors()) if q.path not in autos]
        problems += list(dict.fromkeys(found))  # a union field's members report one problem, once
        model = None
    return (None, problems) if problems else (model, [])


def salvage_section(section: Any) -> tuple[PrecisionConfig | None, set[str]]:
    """The invalid section with every offending value removed (so it takes its default), validated.

    Lets ``validate`` run the cross-checks even when the section has schema errors, so a user sees every error of
    a file at once. Returns the model (None when nothing can be salvaged) and the JSON paths that were removed;
    cross-check problems that involve a removed path must be dropped (they would judge a default, not the file).
    """
    if not isinstance(section, dict):
        return None, set()
    work, removed = copy.deepcopy(section), set()
    for _ in range(8):  # each pass removes at least one key; a section has only a handful of levels
        bad = _auto_locs(work)
        try:
            if not bad:
                return PrecisionConfig.model_validate(work), removed
        except ValidationError as exc:
            bad = [tuple(e["loc"]) for e in exc.errors()]
        for loc in (tuple(itertools.takewhile(lambda k: not isinstance(k, int), b)) for b in bad):
            node = work
            for key in loc[:-1]:
                node = node.get(key) if isinstance(node, dict) else None
            if loc and isinstance(node, dict) and loc[-1] in node:
                del node[loc[-1]]
                removed.add(_json_path(loc))
    return None, removed


def cross_check(ds: dict, pc: PrecisionConfig) -> list[Problem]:
    """Rules between the precision section and the rest of the ds_config (only when enabled)."""
    if not pc.enabled:
        return []
    out: list[Problem] = []
    stage = get_path(ds, "zero_optimization.stage", 0)
    bf16 = get_path(ds, "bf16.enabled", False) or get_path(ds, "bfloat16.enabled", False)
    if get_path(ds, "fp16.enabled", False) is True:
        out.append(Problem("precision.enabled", "NVFP4 training cannot be combined with fp16.enabled: true (it keeps "
                                                "gradients and communication in BF16); set fp16.enabled: false and "
                                                "bf16.enabled: true"))
    if _is_auto(bf16):
        out.append(Problem("bf16.enabled", '"auto": the trainer (HF Trainer/Accelerate) resolves it from its own '
                                           "arguments, and NVFP4 training needs it to resolve to true: pass "
                                           "TrainingArguments(bf16=True) or accelerate's --mixed_precision bf16 "
                                           "(ds_nvfp4.initialize stops the run if it resolves to anything else)",
                           severity="warning"))
    elif bf16 is not True:
        found = _show(get_path(ds, "bf16.enabled"))
        out.append(Problem("precision.enabled", f"needs bf16.enabled: true (found {found}): "
                                                "NVFP4 training keeps weights-in-flight, gradients and communication "
                                                "in BF16; add \"bf16\": {\"enabled\": true}"))
    if pc.weights.storage == "nvfp4" and stage != 3:
        out.append(Problem("precision.weights.storage",
                           f'"nvfp4" needs zero_optimization.stage: 3 (found stage {_show(stage)}): ZeRO stages 0-2 '
                           "keep the full BF16 model on every rank and do not partition weights, so there is nothing "
                           'to store packed; write "storage": "bf16" (FP4 GEMMs, BF16 storage) or use stage 3',
                           ('"bf16"',)))
    if pc.communication.all_gather == "nvfp4" and (stage != 3 or not pc.stored_packed(stage)):
        out.append(Problem("precision.communication.all_gather",
                           f'"nvfp4" gathers the packed partitions, so it needs zero_optimization.stage: 3 (found '
                           f'{_show(stage)}) and precision.weights.storage: "nvfp4" (found '
                           f'{_show(pc.weights.storage)}; null follows the stage)', ('"bf16"',)))
    if pc.backward.gemm == "nvfp4" and pc.weights.block != "16x16":
        out.append(Problem("precision.backward.gemm",
                           f'"nvfp4" needs precision.weights.block: "16x16" (found {_show(pc.weights.block)}): the '
                           "Dgrad GEMM uses the transposed weight codes, and only 16x16 tiles stay the same blocks "
                           "when transposed, so forward and backward see one quantized weight", ('"bf16"',)))
    if pc.weights.scaling == "6" and pc.weights.e4m3_bound not in (None, 448):
        out.append(Problem("precision.weights.e4m3_bound",
                           f"{pc.weights.e4m3_bound} needs precision.weights.scaling: \"4over6\" (found \"6\"): "
                           "standard NVFP4 divides its global scale by 6 * 448; write 448 or null, or scaling "
                           "\"4over6\"", ("448", "null")))
    cdt = get_path(ds, "communication_data_type")
    want = {"bf16": ("bf16", "bfloat16"), "fp32": ("fp32", "float32")}[pc.communication.reduce_scatter]
    if cdt is not None and not _is_auto(cdt) and str(cdt).lower() not in want:
        out.append(Problem("precision.communication.reduce_scatter",
                           f"{_show(pc.communication.reduce_scatter)} disagrees with communication_data_type: "
                           f"{_show(cdt)}; remove communication_data_type (ds_nvfp4 sets it) or make them agree"))
    if pc.stored_packed(stage) and stage == 3:
        out += _packed_storage_conflicts(ds, explicit=pc.weights.storage == "nvfp4")
    if get_path(ds, "bf16.check_grad_overflow", True) is False:
        out.append(Problem("bf16.check_grad_overflow", "is false, so DeepSpeed applies steps whose gradients hold "
                                                       "NaN/Inf and precision.nonfinite cannot stop them before they "
                                                       "reach the FP32 masters; remove it (default true)", ("true",)))
    out += _schedule_problems(ds, pc) + _base_problems(stage, pc)
    if pc.monitor.enabled and not any(get_path(ds, f"{m}.enabled", False) for m in ("tensorboard", "csv_monitor",
                                                                                   "wandb", "comet")):
        out.append(Problem("precision.monitor.enabled", "no DeepSpeed monitor (tensorboard, csv_monitor, wandb, comet) "
                                                        "is enabled, so the statistics are only available from Python",
                           severity="warning"))
    return out


def _schedule_problems(ds: dict, pc: PrecisionConfig) -> list[Problem]:
    """``precision.schedule``: a switch step that exists, a total for fractions, a GEMM that is FP4 to switch."""
    sc, out = pc.schedule, []
    at = sc.bf16_from
    if isinstance(at, float) and not 0.0 < at < 1.0:
        out.append(Problem("precision.schedule.bf16_from", f"{at!r} is a fraction of total_steps, so it must lie "
                                                            "strictly between 0 and 1 (or give a step number, an "
                                                            "integer >= 1)", ("an integer >= 1", "a number in (0, 1)",
                                                                              '"lr_decay"', "null")))
    elif isinstance(at, int) and at < 1:
        out.append(Problem("precision.schedule.bf16_from", f"{at!r}: optimizer steps are counted from 1",
                           ("an integer >= 1", "a number in (0, 1)", '"lr_decay"', "null")))
    elif isinstance(at, float) and schedule_total_steps(ds, pc) is None:
        out.append(Problem("precision.schedule.total_steps", f"bf16_from {at!r} is a fraction of the run, but the "
                                                             "run's length is unknown: set precision.schedule."
                                                             "total_steps, a DeepSpeed scheduler with params."
                                                             "total_num_steps, or give bf16_from as a step number"))
    if at is not None and sc.bf16_gemms == "backward" and pc.backward.gemm == "bf16":
        out.append(Problem("precision.schedule.bf16_gemms", '"backward" switches nothing: precision.backward.gemm is '
                                                            '"bf16" (Dgrad and Wgrad already run in BF16); use '
                                                            '"forward" or "all"', ('"forward"', '"all"')))
    first = first_late_bf16_step(ds, pc)
    if first is not None and first <= sc.bf16_warmup_steps + 1:
        out.append(Problem("precision.schedule.bf16_from", f"the late switch starts at step {first}, within or right "
                                                            f"after the {sc.bf16_warmup_steps} BF16 warm-up steps: no "
                                                            "step would run in FP4"))
    return out


#: DeepSpeed ZeRO-3 features that cannot be combined with ``weights.storage: "nvfp4"``, and why
PACKED_STORAGE_CONFLICTS = {
    "zero_optimization.zero_quantized_weights": (
        True, "ZeRO++ qwZ re-quantizes the gathered weights to int8 with DeepSpeed's CUDA-only quantizer; use "
              'precision.communication.all_gather: "nvfp4" instead (3.5x less traffic, exact)'),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        True, "it swaps frozen weights' partitions for int8 tensors, which the NVFP4 store cannot pack; freeze "
              'nothing or use weights.storage "bf16"'),
    "zero_optimization.offload_param.device": (
        "nvme", "DeepSpeed swaps parameter partitions to NVMe through its own flat buffers, which packed storage "
                'replaces; use offload_param.device "cpu" or weights.storage "bf16"'),
    "zero_optimization.offload_optimizer.device": (
        "nvme", "the packed partitions are re-derived from the FP32 masters after each step, which NVMe "
                'offload keeps swapped out; use offload_optimizer.device "cpu" or weights.storage "bf16"'),
}


def _base_problems(stage: Any, pc: PrecisionConfig) -> list[Problem]:
    """A frozen base read from an NVFP4 checkpoint is multiplied as stored: packed ZeRO-3 partitions of the
    checkpoint's 1x16 blocks, gathered as codes (a BF16 gather would quantize the weight again)."""
    if not (pc.base.frozen and pc.base.checkpoint):
        return []
    need = []
    if stage != 3 or not pc.stored_packed(stage):
        need.append(f"zero_optimization.stage: 3 with packed storage (found stage {_show(stage)}, weights.storage "
                    f"{_show(pc.weights.storage)})")
    if pc.weights.block != "1x16":
        need.append(f'precision.weights.block: "1x16", the checkpoint\'s blocks (found {_show(pc.weights.block)})')
    if pc.communication.all_gather != "nvfp4":
        need.append(f'precision.communication.all_gather: "nvfp4" (found {_show(pc.communication.all_gather)})')
    if pc.weights.bound() != 448:
        need.append(f"the E4M3 bound 448 the checkpoint's block scales were made with (found "
                    f"precision.weights.scaling {_show(pc.weights.scaling)}, bound {pc.weights.bound()}: set "
                    "scaling \"6\" or e4m3_bound 448)")
    if not need:
        return []
    return [Problem("precision.base.checkpoint", "with base.frozen true the forward multiplies the checkpoint's codes "
                                                 "as stored, which needs " + "; ".join(need) + ". Or set "
                                                 "precision.base.frozen false to train every weight from the "
                                                 "dequantized checkpoint (continued training)")]


def _packed_storage_conflicts(ds: dict, explicit: bool) -> list[Problem]:
    storage = 'precision.weights.storage: "nvfp4"' if explicit else \
        "packed NVFP4 storage (weights.storage null follows the stage: packed under ZeRO-3)"
    out = []
    for path, (bad, why) in PACKED_STORAGE_CONFLICTS.items():
        if get_path(ds, path) == bad:
            out.append(Problem(path, f"{_show(bad)} cannot be combined with {storage}: {why}"))
    return out


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


#: DeepSpeed keys that HF Trainer / Accelerate fill when their value is ``"auto"`` (transformers'
#: ``HfTrainerDeepSpeedConfig.trainer_config_process`` and accelerate's ``DeepSpeedPlugin``), with a value of the
#: right type that stands in for it when the rest of the file goes through DeepSpeed's own config models.
TRAINER_AUTO_KEYS: dict[str, Any] = {
    "train_batch_size": None, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0, "bf16.enabled": True, "fp16.enabled": False, "bfloat16.enabled": True,
    "optimizer.params.lr": 1e-3, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": 1e-3, "scheduler.params.warmup_num_steps": 1,
    "scheduler.params.total_num_steps": 10, "scheduler.params.warmup_type": "linear",
    "zero_optimization.reduce_bucket_size": 500_000_000, "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000, "zero_optimization.stage3_max_live_parameters":
    1_000_000_000, "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
}


def trainer_autos(ds: dict) -> tuple[dict, list[Problem]]:
    """``"auto"`` values outside ``precision``: notes for the keys a trainer fills, errors for the others.

    Returns a copy of ``ds`` with each fillable ``"auto"`` replaced by a stand-in of the right type (removed for
    ``train_batch_size``, which depends on the world size), for DeepSpeed's own config models, and the problems.
    """
    out: list[Problem] = []
    filled: list[str] = []
    work = copy.deepcopy(ds)
    for loc in _auto_locs({k: v for k, v in ds.items() if k != SECTION}):
        dotted = ".".join(str(k) for k in loc)
        parent = work
        for k in loc[:-1]:
            parent = parent[k]
        if dotted in TRAINER_AUTO_KEYS:
            if TRAINER_AUTO_KEYS[dotted] is None:
                del parent[loc[-1]]
            else:
                parent[loc[-1]] = TRAINER_AUTO_KEYS[dotted]
            if dotted != "bf16.enabled":  # that one has its own warning (cross_check)
                filled.append(dotted)
        else:
            out.append(Problem(dotted, '"auto" is not a value HF Trainer or Accelerate fill for this key, and '
                                       "DeepSpeed does not accept it; write the value",
                               tuple(sorted(TRAINER_AUTO_KEYS))))
    if filled:
        out.append(Problem(", ".join(filled), '"auto": filled by HF Trainer / Accelerate from their own arguments '
                                              "before deepspeed.initialize sees the config (a plain "
                                              "deepspeed.initialize would reject it)", severity="note"))
    return work, out


def top_level_warnings(ds: dict) -> list[Problem]:
    """Near-misses of ``precision`` or of DeepSpeed's keys (DeepSpeed ignores unknown keys silently)."""
    import ds_nvfp4_autohook

    known = sorted(DEEPSPEED_TOP_LEVEL_KEYS | {SECTION})
    precision_like = set(ds_nvfp4_autohook.near_misses(ds)) if SECTION not in ds else set()
    out = []
    for key in ds:
        if key in DEEPSPEED_TOP_LEVEL_KEYS or key == SECTION or key.startswith("_"):
            continue
        if key in precision_like:
            out.append(Problem(key, f"unknown top-level key that looks like {SECTION!r}: DeepSpeed ignores it, so this "
                                    "config trains WITHOUT NVFP4; rename it to 'precision'", severity="warning",
                               code="near-miss"))
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        if close:
            out.append(Problem(key, f"unknown top-level key (DeepSpeed ignores it silently); did you mean "
                                    f"{close[0]!r}?", severity="warning", code="near-miss"))
    return out
