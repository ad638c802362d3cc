"""Each configuration of bench/multihost.py runs what its name says (its gathers and reduce-scatters pinned, not
inherited from a preset whose defaults moved)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.parametrize("name,gather,scatter,zeropp", [
    ("bf16", "bf16", "bf16", []),
    ("nvfp4_bf16_gather", "bf16", "bf16", []),
    ("nvfp4_nvfp4_gather", "nvfp4", "bf16", []),
    ("nvfp4_fp32_rs", "nvfp4", "fp32", []),
    ("hpz", "bf16", "bf16", ["zero_hpz_partition_size"]),
    ("qwz", "bf16", "bf16", ["zero_quantized_weights"]),
])
def test_each_multihost_configuration_runs_what_its_name_says(name: str, gather: str, scatter: str,
                                                             zeropp: list[str]) -> None:
    import multihost

    from ds_nvfp4.config import load_config

    cfg = multihost.ds_config(name, micro=1)
    assert multihost.pinned(name, cfg) == {"all_gather": gather, "reduce_scatter": scatter, "zeropp": zeropp}
    _, precision = load_config(cfg)  # every configuration is a valid ds_config
    assert precision.enabled == name.startswith("nvfp4")
    if precision.enabled:  # what ds_nvfp4 will do, not only what the dict says
        assert precision.communication.all_gather == gather and precision.communication.reduce_scatter == scatter
