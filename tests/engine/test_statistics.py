"""The statistics feature (engine/statistics.py): per-layer quantization statistics in DeepSpeed's monitor."""

from __future__ import annotations

import math

import pytest

from tests.ranks import run_ranks
from tests.zero.engines import (
    scenario_train,
)


@pytest.mark.slow
def test_precision_statistics_reach_deepspeeds_monitor(tmp_path) -> None:
    """precision.monitor + csv_monitor: ds_nvfp4 writes Train/Precision/... at every interval-th step by itself."""
    run_ranks(scenario_train, steps=5, config={"precision.monitor": {"enabled": True, "interval": 2},
                                        "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                        "job_name": "job"}})
    files = {f.name: f for f in (tmp_path / "job").glob("Train_Precision_*.csv")}
    for name in ("Train_Precision_blocks.1.fc1_input_rel_error.csv", "Train_Precision_odd_weight_amax.csv",
                 "Train_Precision_blocks.2.fc2_grad_output_flushed_to_zero.csv"):
        assert name in files, sorted(files)[:5]
        rows = [ln.split(",") for ln in files[name].read_text().splitlines()[1:]]
        assert [int(r[0]) for r in rows] == [2, 4]  # steps 2 and 4 of 5, once each (rank 0 only)
        assert all(math.isfinite(float(r[1])) for r in rows)
    rel = [float(r.split(",")[1]) for r in files["Train_Precision_blocks.1.fc1_input_rel_error.csv"].read_text()
           .splitlines()[1:]]
    assert all(0.01 < v < 0.3 for v in rel), rel  # 1x16 NVFP4 of Gaussian-like activations: ~10% relative error

