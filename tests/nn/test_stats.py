"""Quantization statistics: captured every `interval` steps, sane values, monitor event names."""

from __future__ import annotations

import torch

import ds_nvfp4
from ds_nvfp4.nn import StatsCollector, tensor_stats
from tests.nn.models import TinyLM


def test_tensor_stats_values() -> None:
    x = torch.randn(64, 128)
    x[0, :16] = 1e-9   # a block flushed to zero next to larger ones? no: own block scale, kept
    x[1, 0] = 1e-6      # tiny element next to normal ones in its block: flushed
    s = tensor_stats(x)
    assert 0 < s["flushed_to_zero"] < 0.2
    assert 0.0 <= s["saturated"] < 0.05
    assert 0.05 < s["rel_error"] < 0.2
    assert s["amax"] == float(x.abs().max())


def test_collector_interval_and_event_names() -> None:
    m = TinyLM()
    ds_nvfp4.convert_model(m, {})
    c = StatsCollector(m, interval=3)
    idx = torch.randint(0, 64, (2, 16))
    seen = []
    events = []
    for step in range(6):
        active = c.step(step)
        m(idx).float().mean().backward()
        seen.append((active, len(c.collect())))
        if step == 3:
            events = c.events(step)
    assert [a for a, _ in seen] == [True, False, False, True, False, False]
    assert all(n > 0 for a, n in seen if a) and all(n == 0 for a, n in seen if not a)
    names = {e[0] for e in events}
    assert "Train/Precision/blocks.0.fc1/input/rel_error" in names
    assert "Train/Precision/blocks.0.fc1/weight/amax" in names
    assert "Train/Precision/blocks.0.fc1/grad_output/flushed_to_zero" in names
    assert all(e[2] == 3 for e in events)
