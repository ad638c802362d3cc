"""``<checkpoint>/<tag>/ds_nvfp4.json``: what an NVFP4 run was, saved beside every DeepSpeed checkpoint.

A versioned pydantic model, read through :func:`read_metadata` only. Schema versions:

* 1 (ds-nvfp4 0.1.0 before the engine lifecycle): no ``schema_version`` key; ``packed`` absent in the oldest files
  (then ``weights.storage: "nvfp4"`` meant packed).
* 2: ``schema_version``, ``ds_nvfp4_version`` and ``world_size`` (how many ranks wrote RNG files) added.
* 3: ``features``: each engine feature's ``state_dict()`` by feature name (engine/lifecycle.py); the schedule's
  state, a top-level ``schedule`` in version 2, is ``features.schedule``.

Older files load (a kept version-1 fixture is tested); a file from a newer ds-nvfp4 is refused with a message that
says so. The ``precision`` section is kept as written (a dict): a section from another release must not make a
checkpoint unreadable; :attr:`CheckpointMetadata.weight_block` and friends read what export needs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..format.scaling import WeightScaling

FILE = "ds_nvfp4.json"
SCHEMA_VERSION = 3


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or not what ds_nvfp4 wrote (the message names the file)."""


class _Record(BaseModel):
    # fields a later release adds are kept, not refused (a newer minor format stays readable)
    model_config = ConfigDict(extra="allow")


class LayerRecord(_Record):
    """One GEMM-bearing module and its decision (``nn.LayerDecision``)."""

    name: str
    in_features: int
    out_features: int
    params: int
    fp4: bool
    reason: str
    kind: str = "Linear"           # schema 1 had Linear layers only
    experts: int | None = None
    transposed: bool = False
    projections: list[list[str]] | None = None   # experts: per-expert module split (nn.LayerDecision)
    bias: str | None = None


class ConversionRecord(_Record):
    """The conversion report (``nn.ConversionReport.to_dict()``)."""

    layers: list[LayerRecord]
    kernel: str = "emulated"
    kernel_reason: str = ""
    blocks: str | None = None
    fp4_params: int = 0
    bf16_params: int = 0
    notes: list[str] = Field(default_factory=list)
    fused_groups: list[list[str]] = Field(default_factory=list)
    moe: list[str] = Field(default_factory=list)


class CheckpointMetadata(_Record):
    """What ``ds_nvfp4.initialize``'s checkpoint feature writes; read by export, resume and ``compare``."""

    schema_version: int = 1
    ds_nvfp4_version: str | None = None
    precision: dict[str, Any]
    conversion: ConversionRecord
    #: each NVFP4 layer's input amax, max over ranks and steps (None: never observed): W4A4 export's input scale
    input_amax: dict[str, float | None] = Field(default_factory=dict)
    #: whether ZeRO-3 partitions were stored packed (None in the oldest files: see :attr:`stored_packed`)
    packed: bool | None = None
    #: converted layers whose ZeRO-3 partitions stayed BF16 (their forward quantized the BF16 copy)
    stored_bf16: list[str] = Field(default_factory=list)
    #: ranks that saved the checkpoint (each wrote its RNG state); None before schema 2
    world_size: int | None = None
    #: each engine feature's state by feature name (``Feature.state_dict``), schema 3 on; read through
    #: :meth:`feature_state`
    features: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: schema 2 only: the schedule feature's state (now ``features["schedule"]``)
    schedule: dict[str, Any] | None = None

    def feature_state(self, name: str) -> dict[str, Any] | None:
        """The state feature ``name`` saved, or None when this file holds none (older files: the schedule's was a
        top-level ``schedule``)."""
        if name in self.features:
            return self.features[name]
        return self.schedule if name == "schedule" and self.schema_version < 3 else None

    @property
    def stored_packed(self) -> bool:
        """Whether converted weights were stored packed (the FP32 master is what their forward quantized)."""
        if self.packed is not None:
            return self.packed
        return self.precision.get("weights", {}).get("storage") == "nvfp4"

    @property
    def weight_block(self) -> str:
        return self.precision.get("weights", {}).get("block", "16x16")

    @property
    def weight_scaling(self) -> WeightScaling:
        """The trained weights' block scaling (standard NVFP4 in files written before 4/6 existed)."""
        from ..config.schema import WeightsConfig

        return WeightsConfig.model_validate(self.precision.get("weights", {})).quantization()

    @property
    def fuse_rules(self) -> list[list[str]]:
        return self.precision.get("modules", {}).get("fuse", [])

    @property
    def activation_hadamard(self) -> bool:
        return bool(self.precision.get("activations", {}).get("hadamard", False))

    def nvfp4_layers(self) -> dict[str, str]:
        """``{layer name: weight block}`` of the layers trained in NVFP4."""
        return {layer.name: self.weight_block for layer in self.conversion.layers if layer.fp4}


def read_metadata(path: str | os.PathLike) -> CheckpointMetadata:
    """Read and check ``path`` (a ``ds_nvfp4.json``). Raises :class:`CheckpointError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON (truncated or damaged?): {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    version = raw.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise CheckpointError(f"{path}: schema_version {version!r} was written by a newer ds-nvfp4 (this one reads "
                              f"1..{SCHEMA_VERSION}); upgrade ds-nvfp4 to read it")
    try:
        return CheckpointMetadata.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise CheckpointError(f"{path}: not a ds_nvfp4 checkpoint description: {where}: {first['msg']}") from None


def write_metadata(path: str | os.PathLike, meta: CheckpointMetadata) -> None:
    """Write ``meta`` to ``path`` through a synced temporary file and a rename (never half-written)."""
    write_atomically(path, meta.model_dump_json(indent=2))


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a synced temporary file and a rename: readers see the old or the new file,
    never a half-written one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
