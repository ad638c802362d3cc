"""torch.compile keeps the FP4 ops as opaque custom ops: same outputs and gradients, the op in the graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_nvfp4


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    ds_nvfp4.convert_model(m, {})
    return m


def test_fp4_op_is_in_the_graph_and_results_equal_eager() -> None:
    m = model()
    graphs: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    x = torch.randn(7, 32, requires_grad=True)
    eager = m(x)
    eager.sum().backward()
    gx, gw = x.grad.clone(), m[0].weight.grad.clone()
    x.grad = None
    m.zero_grad()
    compiled = torch.compile(m, backend=recording_backend, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    assert any("ds_nvfp4.linear_fwd" in g for g in graphs), graphs
    assert torch.equal(out, eager)
    assert torch.equal(x.grad, gx) and torch.equal(m[0].weight.grad, gw)


@pytest.mark.slow
def test_inductor_compiled_model_matches_eager() -> None:
    """With Inductor the surrounding ops are compiled too: outputs equal eager up to Inductor's own rounding
    of the non-FP4 ops (ReLU is exact, so here they are identical)."""
    m = model()
    x = torch.randn(7, 32, requires_grad=True)
    eager = m(x)
    eager.sum().backward()
    gx = x.grad.clone()
    x.grad = None
    out = torch.compile(m, fullgraph=True)(x)
    out.sum().backward()
    assert torch.equal(out, eager) and torch.equal(x.grad, gx)
