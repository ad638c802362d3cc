"""Checkpoint metadata: a versioned model; files of the previous release still load; bad files are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_nvfp4.checkpoint import SCHEMA_VERSION, CheckpointError, CheckpointMetadata, read_metadata
from ds_nvfp4.format import WeightScaling

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1" / "ds_nvfp4.json"


def test_a_version_1_file_written_by_the_previous_release_loads() -> None:
    meta = read_metadata(FIXTURE)
    assert meta.schema_version == 1 and meta.ds_nvfp4_version is None and meta.world_size is None
    assert meta.stored_packed and meta.stored_bf16 == ["odd"] and meta.weight_block == "16x16"
    assert sorted(meta.nvfp4_layers()) == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2",
                                           "blocks.2.fc1", "blocks.2.fc2", "mix", "odd"]
    assert meta.input_amax["blocks.0.fc1"] == pytest.approx(3.453125)
    assert meta.fuse_rules == [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]


def test_round_trip_at_the_current_version(tmp_path: Path) -> None:
    raw = json.loads(FIXTURE.read_text())
    meta = CheckpointMetadata.model_validate({**raw, "schema_version": SCHEMA_VERSION, "world_size": 2})
    from ds_nvfp4.checkpoint import write_metadata

    write_metadata(tmp_path / "ds_nvfp4.json", meta)
    again = read_metadata(tmp_path / "ds_nvfp4.json")
    assert again == meta and again.schema_version == SCHEMA_VERSION
    assert not list(tmp_path.glob("*.tmp*"))


def test_older_files_without_packed_follow_the_storage_setting() -> None:
    raw = json.loads(FIXTURE.read_text())
    del raw["packed"]
    assert CheckpointMetadata.model_validate(raw).stored_packed is True
    raw["precision"]["weights"]["storage"] = "bf16"
    assert CheckpointMetadata.model_validate(raw).stored_packed is False


@pytest.mark.parametrize("text, needle", [
    ('{"precision": {}, "conv', "not valid JSON (truncated or damaged?)"),
    ("[1, 2]", "expected a JSON object"),
    ('{"schema_version": 99, "precision": {}, "conversion": {"layers": []}}', "written by a newer ds-nvfp4"),
    ('{"precision": {}}', "not a ds_nvfp4 checkpoint description: conversion"),
])
def test_bad_files_are_named_with_what_is_wrong(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "ds_nvfp4.json"
    path.write_text(text)
    with pytest.raises(CheckpointError) as info:
        read_metadata(path)
    assert str(info.value).startswith(f"{path}: ") and needle in str(info.value), str(info.value)
    with pytest.raises(CheckpointError, match="missing"):
        read_metadata(tmp_path / "nothing.json")


def test_the_weights_quantization_is_read_back_for_export() -> None:
    """What `ds-nvfp4 export` re-quantizes the masters with: standard NVFP4 for files from before 4/6, the run's
    4/6 arguments otherwise."""
    raw = json.loads(FIXTURE.read_text())
    assert read_metadata(FIXTURE).weight_scaling == WeightScaling("6", 448, "MAE")
    raw["precision"]["weights"].update(scaling="4over6", e4m3_bound=None, scaling_error="MSE")
    meta = CheckpointMetadata.model_validate(raw)
    assert meta.weight_scaling == WeightScaling("4over6", 256, "MSE")
