"""The engine lifecycle: one object owns ds_nvfp4's integration with one DeepSpeed engine.

DeepSpeed offers no step hook, so :func:`install` gives the engine *instance* a mixin class (other engines in the
process are untouched): its ``step`` (``train_batch`` for a ``PipelineEngine``), ``save_checkpoint`` and
``load_checkpoint`` run DeepSpeed's own and then call the features, always in the order of the list
:func:`ds_nvfp4.engine.initialize` builds (docs/architecture.md); its ``backward`` keeps the loss for the step's
:class:`StepOutcome` when a feature reads it (the spike guard), and otherwise only passes it on:

1. ``checkpoint``     metadata, each rank's RNG state and every feature's :meth:`Feature.state_dict`, ``latest``
                      moved atomically (save and load hooks only); first, so that on a load every feature's
                      state is back before any feature's ``after_load`` acts on it;
2. ``weight_cache``   drops the layers' cached weight codes: the next forward must quantize the new weights;
3. ``nonfinite``      reads DeepSpeed's skip of a step with NaN/Inf gradients; raises or counts (after 2, so a
                      caught error leaves no stale codes behind);
4. ``statistics``     writes the finished step's quantization statistics to DeepSpeed's monitor;
5. ``schedule``       puts the engine in the next step's phase (may re-pack the storage): last of the step
                      hooks, because it changes what the next step runs.

A feature with state a resumed run needs (the schedule's learning-rate history and spike-guard episodes, the
non-finite skip counts) returns it from :meth:`Feature.state_dict` (JSON-able) and takes it back in
:meth:`Feature.load_state_dict`, as PyTorch's ``Stateful`` does: the checkpoint feature merges them into the
versioned ``ds_nvfp4.json`` under ``features.<name>``. Adding such a feature is its own file plus one line in the
list :func:`ds_nvfp4.engine.initialize` builds (docs/architecture.md has a worked example).

"An optimizer step happened" is DeepSpeed's own counter moving: ``global_steps`` counts applied and skipped steps
alike, with managed and unmanaged gradient accumulation and in a ``PipelineEngine`` (whose ``train_batch`` never
calls ``step``). ``is_gradient_accumulation_boundary()`` is not asked: with ``managed_gradient_accumulation:
false`` it is True only while ``step()`` runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .state import NVFP4State

log = logging.getLogger("ds_nvfp4")


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step DeepSpeed just took: its number (``global_steps`` after it, from 1) and whether it was
    skipped (non-finite gradients: masters and optimizer state unchanged). With :attr:`Lifecycle.record_loss`:
    the sum and count of this rank's losses of the step (those given to ``backward``; a ``PipelineEngine``: the
    loss ``train_batch`` returned), else 0 and 0."""

    step: int
    skipped: bool
    loss_sum: float = 0.0
    loss_count: int = 0


@dataclass
class SaveContext:
    """A ``save_checkpoint`` call: the folder, the tag it is saved under and whether ``latest`` should move."""

    save_dir: str
    tag: str
    save_latest: bool
    #: set by the checkpoint feature: DeepSpeed's checkpoint engine commits asynchronously and moves ``latest``
    decoupled: bool = False


@dataclass(frozen=True)
class LoadContext:
    """A ``load_checkpoint`` that loaded something: the folder and the tag (None when DeepSpeed found nothing)."""

    load_dir: str
    tag: str | None


class Feature:
    """One concern of the engine integration; each hook is a no-op unless overridden."""

    #: shown in docs and errors ("weight_cache", "nonfinite", ...)
    name = "feature"
    #: whether :meth:`after_step` reads the step's losses (``StepOutcome.loss_sum``): the lifecycle keeps them then
    wants_loss = False

    def after_step(self, state: NVFP4State, outcome: StepOutcome) -> None:
        """An optimizer step was applied or skipped."""

    def before_save(self, state: NVFP4State, save: SaveContext) -> None:
        """Before DeepSpeed writes a checkpoint (every rank; collectives allowed)."""

    def after_save(self, state: NVFP4State, save: SaveContext) -> None:
        """After DeepSpeed's closing barrier: every rank's files are complete."""

    def after_load(self, state: NVFP4State, load: LoadContext) -> None:
        """After DeepSpeed loaded a checkpoint (model, masters, optimizer state, step counters) and every feature
        got its saved state back (:meth:`load_state_dict`)."""

    def state_dict(self) -> dict | None:
        """What a resumed run needs of this feature, JSON-able (saved in ``ds_nvfp4.json`` under
        ``features.<name>``); None: the feature has no state."""
        return None

    def load_state_dict(self, saved: dict | None, source: str) -> None:
        """Take back what :meth:`state_dict` returned. ``saved`` is None when the checkpoint holds nothing for this
        feature (a plain DeepSpeed checkpoint, or one from a run without it): start afresh and say so. ``source``
        names the file, for messages."""


class Lifecycle:
    """The ordered features of one engine, and the calls that drive them (from the engine mixin)."""

    def __init__(self, engine, state: NVFP4State, features: list[Feature]) -> None:
        self.engine = engine
        self.state = state
        self.features = list(features)
        #: keep the losses given to ``backward`` for the step's outcome (only when a feature reads them)
        self.record_loss = any(f.wants_loss for f in self.features)
        self._losses: list = []

    @property
    def order(self) -> list[str]:
        return [f.name for f in self.features]

    def state_dicts(self) -> dict[str, dict]:
        """Every feature's state that a resumed run needs, by feature name (features without state left out)."""
        return {f.name: sd for f in self.features if (sd := f.state_dict()) is not None}

    def note_loss(self, loss: Any) -> None:
        """A loss given to ``engine.backward`` (kept detached, summed at the step: no sync per micro-batch)."""
        if self.record_loss and hasattr(loss, "detach"):
            self._losses.append(loss.detach().float().sum())

    def _step_losses(self, out: Any) -> tuple[float, int]:
        if not self.record_loss:
            return 0.0, 0
        losses, self._losses = self._losses, []
        if not losses and hasattr(out, "detach"):  # PipelineEngine.train_batch: its loss, backward not called
            losses = [out.detach().float().sum()]
        return (float(sum(losses)), len(losses)) if losses else (0.0, 0)

    def run_step(self, step: Callable[[], Any]) -> Any:
        """Run DeepSpeed's step (``step`` or ``train_batch``); the features see each optimizer step it took."""
        e = self.engine
        steps, skipped = e.global_steps, e.skipped_steps
        out = step()
        if e.global_steps != steps:
            outcome = StepOutcome(e.global_steps, e.skipped_steps != skipped, *self._step_losses(out))
            for f in self.features:
                f.after_step(self.state, outcome)
        return out

    def run_save(self, save: Callable[..., Any], save_dir, tag, client_state, save_latest: bool,
                 exclude_frozen_parameters: bool) -> Any:
        ctx = SaveContext(str(save_dir), str(tag if tag is not None else f"global_step{self.engine.global_steps}"),
                          save_latest)
        for f in self.features:
            f.before_save(self.state, ctx)
        # ``latest`` is the checkpoint feature's to move (after every rank finished), unless DeepSpeed's decoupled
        # checkpoint engine commits later and moves it then (DeepSpeed's own rule)
        out = save(save_dir, tag, client_state if client_state is not None else {},
                   save_latest=save_latest and ctx.decoupled, exclude_frozen_parameters=exclude_frozen_parameters)
        for f in self.features:
            f.after_save(self.state, ctx)
        return out

    def run_load(self, load: Callable[..., Any], load_dir, tag, *args, **kwargs) -> Any:
        out = load(load_dir, tag, *args, **kwargs)
        if out[0] is not None:  # DeepSpeed loaded something (it returns (None, None) when there is nothing)
            if tag is None:
                with open(f"{load_dir}/latest") as fh:
                    tag = fh.read().strip()
            ctx = LoadContext(str(load_dir), str(tag))
            for f in self.features:
                f.after_load(self.state, ctx)
        return out


class _EngineHooks:
    """Mixed into one DeepSpeedEngine instance by :func:`install` (signatures: DeepSpeed 0.19's)."""

    def backward(self, loss, *args, **kwargs):
        self.ds_nvfp4.lifecycle.note_loss(loss)
        return super().backward(loss, *args, **kwargs)

    def step(self, *args, **kwargs):
        return self.ds_nvfp4.lifecycle.run_step(lambda: super(_EngineHooks, self).step(*args, **kwargs))

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        return self.ds_nvfp4.lifecycle.run_save(super().save_checkpoint, save_dir, tag, client_state, save_latest,
                                                exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        return self.ds_nvfp4.lifecycle.run_load(super().load_checkpoint, load_dir, tag, *args, **kwargs)


class _PipelineHooks(_EngineHooks):
    """A PipelineEngine's optimizer step happens inside ``train_batch`` (its ``step`` raises)."""

    def train_batch(self, data_iter=None):
        return self.ds_nvfp4.lifecycle.run_step(lambda: super(_PipelineHooks, self).train_batch(data_iter))


def is_pipeline(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def install(engine, state: NVFP4State, features: list[Feature]) -> Lifecycle:
    """Attach ``state`` (``engine.ds_nvfp4``) and the lifecycle to ``engine``, once."""
    if getattr(engine, "ds_nvfp4", None) is not None:
        raise RuntimeError("ds_nvfp4: this engine already has an NVFP4 lifecycle (initialize was called twice on it)")
    state.lifecycle = Lifecycle(engine, state, features)
    engine.ds_nvfp4 = state
    base = type(engine)
    hooks = _PipelineHooks if is_pipeline(engine) else _EngineHooks
    engine.__class__ = type(f"NVFP4{base.__name__}", (hooks, base), {})
    return state.lifecycle
