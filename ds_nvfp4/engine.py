"""`ds_nvfp4.initialize`: ``deepspeed.initialize`` with NVFP4 (a one-line change in a training script).

Reads the ``precision`` section from the same ds_config (a path, a dict, or ``args.deepspeed_config``),
validates it, converts the model's Linear layers, calls ``deepspeed.initialize`` unchanged, then (ZeRO-3 with
``weights.storage: "nvfp4"``) packs the weight partitions. With ``precision.enabled`` false or absent it *is*
``deepspeed.initialize``: same arguments, same return tuple; the one thing added in both cases is unlinking
DeepSpeed's CPU shared-memory all-reduce segments once every rank has mapped them (DeepSpeed leaks ~69 MB of
``/dev/shm`` per rank and run otherwise; see ``zero/shm.py``).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import ds_nvfp4_autohook

from .config import ConfigError, PrecisionConfig, Problem, load_config
from .export import CHECKPOINT_META
from .kernels import Selection, select
from .nn import ConversionReport, NonFiniteError, NVFP4Linear, StatsCollector, convert_model, nonfinite_layers
from .nn.linear import invalidate_weight_caches
from .schedule import SchedulePlan, ScheduleState, apply_phase
from .zero.shm import release_shm_workspace

log = logging.getLogger("ds_nvfp4")


@dataclass
class NVFP4State:
    """What ``initialize`` did, attached to the engine as ``engine.ds_nvfp4``."""

    precision: PrecisionConfig
    selection: Selection
    conversion: ConversionReport
    store: Any = None              # zero.NVFP4Store when weights are stored packed
    stats: StatsCollector | None = None
    skipped_steps: int = 0         # optimizer steps skipped for non-finite gradients (precision.nonfinite)
    consecutive_skips: int = 0
    schedule: ScheduleState | None = None   # precision.schedule: the current phase and its transitions

    def fp4_gemm_share(self, steps: int) -> float:
        """Fraction of the Linear GEMM FLOPs of optimizer steps 1..``steps`` that run in FP4 (schedule included)."""
        layers = self.conversion.layers
        return self.schedule.plan.fp4_share(steps, sum(d.params for d in layers if d.fp4),
                                            sum(d.params for d in layers))


def _resolve_config(bound: inspect.BoundArguments) -> tuple[str, Any]:
    """Which argument holds the ds_config, and its value (dict or path)."""
    for key in ("config", "config_params"):
        if bound.arguments.get(key) is not None:
            return key, bound.arguments[key]
    args = bound.arguments.get("args")
    path = getattr(args, "deepspeed_config", None) if args is not None else None
    if path is None:
        raise ConfigError([Problem("(config)", "no ds_config given: pass config=..., config_params=... or "
                                               "args.deepspeed_config")])
    return "args", path


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize`` (same signature and return tuple).

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; ``engine.ds_nvfp4`` holds the
    :class:`NVFP4State` (conversion report, kernel selection, storage) when NVFP4 is enabled.

    Raises:
        ConfigError: the ``precision`` section (or its cross-checks) is invalid; nothing was started.
        kernels.BackendUnavailable: ``precision.kernel`` cannot run here.
        zero.UnsupportedDeepSpeed: the installed DeepSpeed lacks what packed ZeRO-3 storage needs.
    """
    import deepspeed

    # DeepSpeed's own function, also when the start-up hook wrapped deepspeed.initialize (which calls us)
    deepspeed_initialize = ds_nvfp4_autohook.original_initialize(deepspeed)
    bound = inspect.signature(deepspeed_initialize).bind(*args, **kwargs)
    where, source = _resolve_config(bound)
    ds_config, precision = load_config(source)
    if not precision.enabled:
        result = deepspeed_initialize(*args, **kwargs)
        release_shm_workspace()
        return result

    ds_config = copy.deepcopy(ds_config)
    if precision.communication.reduce_scatter == "fp32":
        ds_config.setdefault("communication_data_type", "fp32")
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    packed = precision.weights.storage == "nvfp4"
    if packed:  # (the DeepSpeed features packed storage excludes are config rules: config/checks.py)
        from .zero.guard import check_version

        warning = check_version(os.environ.get("DS_NVFP4_ALLOW_UNTESTED_DEEPSPEED") == "1")
        if warning:
            log.warning("ds_nvfp4: %s", warning)

    model = bound.arguments.get("model")
    if model is None:
        raise ValueError("ds_nvfp4.initialize needs model=... (the module to convert)")
    selection = select(precision.kernel)
    conversion = convert_model(model, precision, selection=selection)
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
    release_shm_workspace()

    state = NVFP4State(precision, selection, conversion)
    if packed and stage == 3:
        from .zero import install

        names = {id(p): n for n, p in engine.module.named_parameters()}
        converted = {id(engine.module.get_submodule(d.name).weight) for d in conversion.layers if d.fp4}
        fused = [[id(engine.module.get_submodule(n).weight) for n in g] for g in conversion.fused_groups]
        state.store = install(engine, names, converted, precision.weights.block, precision.communication.all_gather,
                              fused)
        for name, why in state.store.kept_bf16.items():
            conversion.notes.append(f"{name}: FP4 GEMMs, but its ZeRO-3 partition is stored BF16: {why}")
        for label, why in state.store.unfused.items():
            _unfuse(engine.module, conversion, [label.split(", ")], why)
    if precision.monitor.enabled:
        state.stats = StatsCollector(engine.module, precision.monitor.interval)
        _emit_stats(engine, state.stats)
    engine.ds_nvfp4 = state
    _guard_nonfinite(engine, state)
    _describe_checkpoints(engine, state)
    _cache_weights(engine, state, stage)
    _run_schedule(engine, state, SchedulePlan.from_config(precision, ds_config))
    if _is_rank0():
        report = state.store.report() if state.store is not None else None
        announce(summary_line(state, report) + "\n" + conversion.table()
                 + (f"\n{report.summary()}" if report is not None else ""))
    return engine, optimizer, loader, scheduler


def announce(text: str) -> None:
    """Say ``text`` where the user looks: through the ``ds_nvfp4`` logger when the program shows its INFO
    records, else on stderr (as DeepSpeed's own logger does, whatever ``logging`` set-up the script has)."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", text)
    else:
        print(text, file=sys.stderr, flush=True)


def summary_line(state: NVFP4State, report=None) -> str:
    """One line: what is NVFP4, with which recipe and kernel, and how many bytes the packed weights take."""
    c, p = state.conversion, state.precision
    kept = c.kept_bf16
    kept_text = f"{len(kept)} kept BF16" + (f" ({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''})"
                                            if kept else "")
    total = c.fp4_params + c.bf16_params
    recipe = ("paper: FP4 forward and backward" if p.backward.gemm == "nvfp4" else "mission: FP4 forward, BF16 "
              "backward") + f", weights {p.weights.block}" + (", RHT" if p.activations.hadamard else "")
    text = (f"ds_nvfp4: NVFP4 training ON: {len(c.converted)} Linear layers NVFP4, {kept_text}; "
            f"{c.fp4_params / total if total else 0:.1%} of parameters; recipe {recipe}; kernel {c.kernel}"
            + (f" ({state.selection.operand.split(' (')[0]})" if state.selection.operand else ""))
    if c.fused_groups:
        text += f"; {len(c.fused_groups)} fused groups share an amax"
    if report is not None:
        text += (f"; ZeRO-3 weights packed: {report.packed_bytes:,} bytes vs {report.packed_bf16_equivalent_bytes:,} "
                 f"in BF16 ({report.ratio:.3f}x, rank {report.rank})")
    else:
        text += f"; weights stored BF16 (weights.storage {p.weights.storage!r})"
    return text


def _guard_nonfinite(engine, state: NVFP4State) -> None:
    """``precision.nonfinite``: act on the steps DeepSpeed skips for NaN/Inf gradients.

    DeepSpeed's BF16 optimizers (every ZeRO stage, ``bf16.check_grad_overflow`` true) already test the gradient
    norm, agree on the result across ranks, and skip the step, leaving masters and optimizer state untouched; they
    count it in ``engine.skipped_steps``. This wrapper reads that counter (no second pass over the gradients) and
    raises :class:`NonFiniteError` on every rank, or counts, reports and bounds the skips.
    """
    cfg = state.precision.nonfinite
    original_step = engine.step

    def step(*args, **kwargs):
        before = engine.skipped_steps
        boundary = engine.is_gradient_accumulation_boundary()
        out = original_step(*args, **kwargs)
        if not boundary:
            return out
        invalidate_weight_caches()  # the optimizer step changed the weights: quantize them again
        skipped = engine.skipped_steps != before
        culprits = nonfinite_layers(engine.module, read=skipped)  # flags reset every optimizer step
        if not skipped:
            state.consecutive_skips = 0
            return out
        state.skipped_steps += 1
        state.consecutive_skips += 1
        step_no = engine.global_steps  # DeepSpeed counts skipped steps too: this is the attempted step, from 1
        where = (f"first FP4 layers with a non-finite input or output on this rank: {', '.join(culprits[:4])}"
                 if culprits else "no FP4 layer saw a non-finite forward input or output on this rank: the values "
                                  "arose in the backward, the loss or a BF16 layer")
        what = (f"ds_nvfp4: step {step_no}: gradients hold NaN/Inf (DeepSpeed's gradient-norm check); {where}; "
                "the FP32 masters and optimizer state are unchanged")
        if cfg.action == "raise":
            raise NonFiniteError(what + ' (precision.nonfinite.action: "raise")')
        if state.consecutive_skips > cfg.max_consecutive_skips:
            raise NonFiniteError(f"{what}; {state.consecutive_skips} steps in a row were skipped, more than "
                                 f"precision.nonfinite.max_consecutive_skips ({cfg.max_consecutive_skips})")
        if _is_rank0():  # WARNING reaches stderr even where the script configured no logging (last resort)
            log.warning("%s; skipped (%d skipped so far, %d in a row)", what, state.skipped_steps,
                        state.consecutive_skips)
        if engine.monitor.enabled:
            engine.monitor.write_events([("Train/Precision/skipped_steps", state.skipped_steps,
                                          engine.global_samples)])
        return out

    engine.step = step


def _unfuse(model, conversion: ConversionReport, groups: list[list[str]], why: str) -> None:
    """Groups that cannot share an amax here: each member quantizes with its own (said in the report)."""
    for names in list(groups):
        for n in names:
            model.get_submodule(n).fused_peers = ()
        if names in conversion.fused_groups:
            conversion.fused_groups.remove(names)
        conversion.notes.append(f"fused group {', '.join(names)} does not share an amax: {why}; an NVFP4 export "
                                "re-quantizes it with one global scale (and says so)")


def _emit_stats(engine, stats: StatsCollector) -> None:
    """Capture the quantization statistics on every ``monitor.interval``-th optimizer step and write them to
    DeepSpeed's monitor (TensorBoard/CSV/W&B as configured) as ``Train/Precision/<layer>/...`` at that step, with
    no change to the user's training loop. Steps are counted from 1, like DeepSpeed's own ``Train/Samples`` events.
    """
    def before_forward(module, args):
        if module.training:
            stats.step(engine.global_steps + 1)

    engine.module.register_forward_pre_hook(before_forward)
    original_step = engine.step

    def step(*args, **kwargs):
        events = []
        if engine.is_gradient_accumulation_boundary():
            events = stats.events(engine.global_steps + 1)
            stats.stop()  # evaluation forwards until the next training forward are not captured
        out = original_step(*args, **kwargs)
        if events and engine.monitor.enabled:
            engine.monitor.write_events(events)  # DeepSpeed's monitor writes on rank 0 only
        return out

    engine.step = step




def _cache_weights(engine, state: NVFP4State, stage: int) -> None:
    """Quantize each FP4 weight once per optimizer step (ZeRO-0/1/2): the step's other forwards (gradient
    accumulation, activation-checkpointing recomputation, evaluation) reuse its codes. The step wrapper and
    ``load_checkpoint`` bump the generation that invalidates them. Not under ZeRO-3: there the full weight exists
    only while gathered, and keeping every layer's codes would hold 0.28x of the whole model on each rank.
    ``DS_NVFP4_WEIGHT_CACHE=0`` turns it off (the codes are the same either way; tested)."""
    enabled = stage < 3 and os.environ.get("DS_NVFP4_WEIGHT_CACHE", "1").strip() != "0"
    for m in engine.module.modules():
        if isinstance(m, NVFP4Linear):
            m.cache_weight = enabled
    if enabled:
        note = "weight quantization: once per optimizer step, reused by the step's other forwards"
    elif stage >= 3 and state.store is not None and state.precision.communication.all_gather == "nvfp4":
        note = ("weight quantization: none for weights stored packed (the forward uses the NVFP4 codes as gathered, "
                "all_gather \"nvfp4\"), every forward for the others")
    elif stage >= 3:
        note = "weight quantization: every forward (ZeRO-3 gathers weights per forward; all_gather \"nvfp4\" would " \
               "hand the forward the stored codes instead)"
    else:
        note = "weight quantization: every forward (DS_NVFP4_WEIGHT_CACHE=0)"
    state.conversion.notes.append(note)
    original_load = engine.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        out = original_load(*args, **kwargs)
        invalidate_weight_caches()
        return out

    engine.load_checkpoint = load_checkpoint


def _run_schedule(engine, state: NVFP4State, plan: SchedulePlan) -> None:
    """``precision.schedule``: put the engine in the phase of its next optimizer step now, after every optimizer step
    and after a checkpoint load (the phase depends on the step number only, so a resumed run matches). With a
    DeepSpeed monitor, ``Train/Precision/fp4_forward`` and ``fp4_backward`` (1/0, at the step number) record what
    each step ran."""
    state.schedule = sched = ScheduleState(plan)

    def to_next_step() -> None:
        if apply_phase(engine, sched, engine.global_steps + 1) and plan.active and _is_rank0():
            announce(f"ds_nvfp4: precision.schedule: from step {engine.global_steps + 1}, "
                     f"{sched.current.describe()}" + ("" if sched.current.packed or state.store is None
                                                      else " (weights stored BF16)"))

    to_next_step()
    if plan.active:
        state.conversion.notes.append("precision.schedule: " + "; ".join(plan.describe()))
    original_step, original_load = engine.step, engine.load_checkpoint

    def step(*args, **kwargs):
        ran = sched.current
        boundary = engine.is_gradient_accumulation_boundary()
        out = original_step(*args, **kwargs)
        if boundary:
            if plan.active and engine.monitor.enabled:
                engine.monitor.write_events([("Train/Precision/fp4_forward", float(ran.forward_fp4),
                                              engine.global_steps),
                                             ("Train/Precision/fp4_backward", float(ran.backward_fp4),
                                              engine.global_steps)])
            to_next_step()
        return out

    def load_checkpoint(*args, **kwargs):
        out = original_load(*args, **kwargs)
        to_next_step()
        return out

    engine.step, engine.load_checkpoint = step, load_checkpoint


def _describe_checkpoints(engine, state: NVFP4State) -> None:
    """Make checkpoints self-describing and crash-safe.

    ``<dir>/<tag>/ds_nvfp4.json`` holds the precision section and the conversion report (which layers are NVFP4).
    ``<dir>/latest`` moves to the new tag only once *every* rank has written its files: DeepSpeed 0.19 lets rank 0
    write ``latest`` before the closing barrier, so a rank killed while writing its ZeRO partition left ``latest``
    naming a checkpoint with a truncated file. Here DeepSpeed saves with ``save_latest=False``; after its closing
    barrier (all ranks done) rank 0 writes the metadata, then ``latest``, each to a temporary file renamed into
    place. A crash at any point leaves ``latest`` on the previous complete checkpoint.
    """
    import json

    original = engine.save_checkpoint

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        input_amax = _agreed_input_amax(engine.module)  # a collective: every rank saves
        real_tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
        _save_rng(os.path.join(str(save_dir), real_tag))  # before DeepSpeed's closing barrier: covered by `latest`
        checkpoint_engine = getattr(engine, "checkpoint_engine", None)
        # a decoupled engine commits later, asynchronously, and writes ``latest`` then: DeepSpeed's own rule
        decoupled = checkpoint_engine is not None and checkpoint_engine.is_decoupled()
        ok = original(save_dir, tag, client_state if client_state is not None else {},
                      save_latest=save_latest and decoupled, exclude_frozen_parameters=exclude_frozen_parameters)
        # DeepSpeed ends with dist.barrier(): past this line every rank's files are complete
        if _is_rank0():
            meta = {"precision": state.precision.model_dump(), "conversion": state.conversion.to_dict(),
                    "input_amax": input_amax, "packed": state.store is not None,
                    # converted weights whose partitions stay BF16: their forward quantizes the BF16 copy
                    "stored_bf16": sorted(n.removesuffix(".weight") for n in state.store.kept_bf16)
                    if state.store is not None else []}
            _write_atomically(os.path.join(str(save_dir), real_tag, CHECKPOINT_META), json.dumps(meta, indent=2))
            if save_latest and not decoupled:
                _write_atomically(os.path.join(str(save_dir), "latest"), real_tag)
        return ok

    original_load = engine.load_checkpoint

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        out = original_load(load_dir, tag, *args, **kwargs)
        if out[0] is not None:
            if tag is None:
                with open(os.path.join(str(load_dir), "latest")) as fh:
                    tag = fh.read().strip()
            _load_rng(os.path.join(str(load_dir), str(tag)))
        return out

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint


#: each rank's random-number state in a checkpoint: stochastic rounding (the paper recipe) draws from torch's
#: generators, so a resumed run repeats the uninterrupted one bit for bit only if they continue where they were
RNG_FILE = "ds_nvfp4_rng_rank{rank}.pt"


def _rng_path(tag_dir: str) -> str:
    return os.path.join(tag_dir, RNG_FILE.format(rank=int(os.environ.get("RANK", "0"))))


def _save_rng(tag_dir: str) -> None:
    import torch

    state = {"cpu": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}
    os.makedirs(tag_dir, exist_ok=True)
    path = _rng_path(tag_dir)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_rng(tag_dir: str) -> None:
    """Restore this rank's generators; a checkpoint from another number of ranks (or an older one) has no file for
    this rank: then the generators continue from this process's seed, and the run says so."""
    import torch

    path = _rng_path(tag_dir)
    if not os.path.exists(path):
        if _is_rank0():
            log.warning("ds_nvfp4: %s has no random-number state for this rank (saved with another number of ranks "
                        "or by an older ds_nvfp4): stochastic rounding continues from this process's seed, so the "
                        "resumed run is not bit-identical to an uninterrupted one", tag_dir)
        return
    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a synced temporary file and a rename: readers see the old or the new file,
    never a half-written one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _agreed_input_amax(module) -> dict[str, float | None]:
    """Each NVFP4 layer's running input amax, max over all ranks (one collective; None where never observed)."""
    import torch

    from .nn import NVFP4Linear
    from .zero.collectives import agree_max

    layers = [(n, m) for n, m in module.named_modules() if isinstance(m, NVFP4Linear)]
    if not layers:
        return {}
    # -1 marks "never observed" (amaxes are >= 0)
    amax, bad = agree_max(torch.tensor([float(m.input_amax) if m.input_amax is not None else -1.0
                                        for _, m in layers], dtype=torch.float32))
    return {n: (None if bad[i] > 0 or amax[i] < 0 else float(amax[i])) for i, (n, _) in enumerate(layers)}


def storage_report(engine):
    """Per-rank :class:`zero.StorageReport` of an engine from ``ds_nvfp4.initialize`` (None without packed storage)."""
    state = getattr(engine, "ds_nvfp4", None)
    return state.store.report() if state is not None and state.store is not None else None
