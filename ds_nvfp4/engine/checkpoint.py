"""Feature ``checkpoint``: self-describing, crash-safe checkpoints that resume bit for bit.

* ``<dir>/<tag>/ds_nvfp4.json`` (checkpoint/metadata.py) holds the precision section, the conversion report, the
  agreed input amaxes (W4A4 export), the storage facts and every feature's ``state_dict()``; on a load each feature
  gets its own back (``load_state_dict``) before any feature's ``after_load`` runs (this feature is first).
* ``<dir>/<tag>/ds_nvfp4_rng_rank{r}.pt``: each rank's random-number state (stochastic rounding draws from torch's
  generators), written *before* DeepSpeed's closing barrier, so ``latest`` never names a checkpoint without it.
* ``<dir>/latest`` moves to the new tag only once every rank has written its files: DeepSpeed 0.19 lets rank 0
  write ``latest`` before the closing barrier, so a rank killed while writing its ZeRO partition left ``latest``
  naming a torn checkpoint. Here DeepSpeed saves with ``save_latest=False`` (lifecycle.py); after its closing
  barrier rank 0 writes the metadata, then ``latest``, each through a temporary file renamed into place.
"""

from __future__ import annotations

import logging
import os

import torch

from .._version import __version__
from ..checkpoint.metadata import (
    FILE,
    SCHEMA_VERSION,
    CheckpointError,
    CheckpointMetadata,
    read_metadata,
    write_atomically,
    write_metadata,
)
from .lifecycle import Feature, LoadContext, SaveContext
from .state import NVFP4State

log = logging.getLogger("ds_nvfp4")

#: each rank's random-number state in a checkpoint
RNG_FILE = "ds_nvfp4_rng_rank{rank}.pt"


def rng_path(tag_dir: str, rank: int) -> str:
    return os.path.join(tag_dir, RNG_FILE.format(rank=rank))


class Checkpoints(Feature):
    name = "checkpoint"

    def __init__(self, engine) -> None:
        self.engine = engine
        self._input_amax: dict[str, float | None] = {}

    def before_save(self, state: NVFP4State, save: SaveContext) -> None:
        from .input_amax import agreed_input_amax

        self._input_amax = agreed_input_amax(self.engine.module)  # a collective: every rank saves
        tag_dir = os.path.join(save.save_dir, save.tag)
        os.makedirs(tag_dir, exist_ok=True)
        path = rng_path(tag_dir, state.rank)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized()
                    else None}, tmp)
        os.replace(tmp, path)
        ce = getattr(self.engine, "checkpoint_engine", None)
        save.decoupled = ce is not None and ce.is_decoupled()

    def after_save(self, state: NVFP4State, save: SaveContext) -> None:
        # DeepSpeed ends save_checkpoint with dist.barrier(): every rank's files are complete here
        if state.rank != 0:
            return
        store = state.store
        meta = CheckpointMetadata(
            schema_version=SCHEMA_VERSION, ds_nvfp4_version=__version__, precision=state.precision.model_dump(),
            conversion=state.conversion.to_dict(), input_amax=self._input_amax, packed=store is not None,
            stored_bf16=sorted(n.removesuffix(".weight") for n in store.kept_bf16) if store is not None else [],
            world_size=state.world_size, features=state.lifecycle.state_dicts())
        write_metadata(os.path.join(save.save_dir, save.tag, FILE), meta)
        if save.save_latest and not save.decoupled:
            write_atomically(os.path.join(save.save_dir, "latest"), save.tag)

    def after_load(self, state: NVFP4State, load: LoadContext) -> None:
        """Every feature's saved state back; this rank's generators restored (or why the resumed run will not repeat
        an uninterrupted one)."""
        tag_dir = os.path.join(load.load_dir, load.tag)
        file = os.path.join(tag_dir, FILE)
        try:
            meta = read_metadata(file)
        except CheckpointError as exc:
            meta = None  # each feature starts afresh (and says so)
            if os.path.exists(file) and state.rank == 0:
                log.warning("ds_nvfp4: %s; the weights, masters and optimizer state loaded, the ds_nvfp4 features "
                            "start afresh", exc)
        for f in state.lifecycle.features:
            f.load_state_dict(meta.feature_state(f.name) if meta is not None else None, file)
        self._restore_rng(state, tag_dir, meta)

    def _restore_rng(self, state: NVFP4State, tag_dir: str, meta: CheckpointMetadata | None) -> None:
        path = rng_path(tag_dir, state.rank)
        if os.path.exists(path):
            saved = torch.load(path, weights_only=True)
            torch.set_rng_state(saved["cpu"])
            if saved["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(saved["cuda"])
            return
        if state.rank != 0:
            return
        if meta is None:
            why = (f"{tag_dir} is a plain DeepSpeed checkpoint (no {FILE}): its weights, FP32 masters and optimizer "
                   "state loaded as usual, and it holds no random-number state")
        elif meta.world_size is not None and meta.world_size != state.world_size:
            why = f"{tag_dir} was saved by {meta.world_size} ranks; rank {state.rank} of {state.world_size} has no " \
                  "random-number state there"
        else:
            why = f"{tag_dir} has no random-number state for rank {state.rank}"
        pc = state.precision
        if pc.backward.gemm == "nvfp4" and pc.backward.stochastic_rounding:
            log.warning("ds_nvfp4: %s: stochastic rounding continues from this process's seed, so the resumed run is "
                        "not bit-identical to an uninterrupted one", why)
        else:
            log.info("ds_nvfp4: %s; that is fine: this recipe draws no random numbers (no stochastic rounding)", why)
