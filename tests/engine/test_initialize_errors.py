"""Errors ds_nvfp4.initialize raises before anything starts (no process group needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ds_nvfp4
from ds_nvfp4.kernels import BackendUnavailable

PRESET = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / "nvfp4_zero3.json").read_text())


def cfg(**precision) -> dict:
    d = json.loads(json.dumps(PRESET))
    d["precision"].update(precision)
    return d


def test_invalid_precision_section_is_a_config_error() -> None:
    model = torch.nn.Linear(32, 32)
    with pytest.raises(ds_nvfp4.ConfigError, match=r"precision\.weights\.storage"):
        ds_nvfp4.initialize(model=model, config=cfg(weights={"storage": "int4"}))


def test_unavailable_kernel_is_an_error_at_start() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the CPU refusal is what is tested here")
    with pytest.raises(BackendUnavailable, match="'torch' cannot run here: no CUDA device: CPU"):
        ds_nvfp4.initialize(model=torch.nn.Linear(32, 32), config=cfg(kernel="torch"))


def test_qwz_cannot_be_combined_with_packed_storage() -> None:
    d = cfg()
    d["zero_optimization"]["zero_quantized_weights"] = True
    with pytest.raises(ds_nvfp4.ConfigError, match=r"zero_optimization\.zero_quantized_weights.*all_gather"):
        ds_nvfp4.initialize(model=torch.nn.Linear(32, 32), config=d)


def test_missing_config() -> None:
    with pytest.raises(ds_nvfp4.ConfigError, match="no ds_config given"):
        ds_nvfp4.initialize(model=torch.nn.Linear(32, 32))
