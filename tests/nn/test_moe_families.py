"""Every MoE family of the installed transformers, found from its registry: experts FP4 (or explained), every weight of
two or more dimensions accounted for, routers BF16 by role, and a forward + backward close to BF16's."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.integrations.moe_families import Unbuildable, build, moe_families

pytestmark = pytest.mark.slow

#: families whose experts are no GEMM weights, with what they are instead (checked below, not just skipped)
EMBEDDING_EXPERTS = {"doge": "product-key retrieval experts: one vector per expert in nn.Embedding tables"}


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("family", list(moe_families()))
def test_every_moe_family_is_fp4_or_explained(family: str) -> None:
    from ds_nvfp4.nn import convert_model
    from ds_nvfp4.nn.intercept import FP4InterceptedExperts
    from ds_nvfp4.nn.moe import shape_of

    try:
        model = build(family)
    except Unbuildable as exc:
        pytest.skip(f"{family}: {exc}")
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model)
    try:
        ref_loss = _loss(ref, ids)
        ref_loss.backward()
    except Exception as exc:  # the family's own forward, before ds_nvfp4 touched anything
        pytest.skip(f"{family}: its own tiny model does not run on CPU: {type(exc).__name__}: {str(exc)[:160]}")

    report = convert_model(model, {"enabled": True})
    rows = report.layers
    # every floating parameter of >= 2 dimensions has exactly one row (tied weights once)
    params = {id(p): n for n, p in model.named_parameters() if p.is_floating_point() and len(shape_of(p)) >= 2}
    assert len(rows) == len(params) == len({r.name for r in rows}), (len(rows), len(params))
    unknown = [r for r in rows if r.kind == "unknown"]
    assert all(r.reason.startswith("unknown: kept BF16") and not r.fp4 for r in unknown)

    experts = [r for r in rows if r.kind == "experts"]
    if family in EMBEDDING_EXPERTS:
        assert not experts and any(r.kind == "embedding" and ".layers." in r.name for r in rows), rows
    else:
        assert experts and all(r.fp4 for r in experts), [(r.name, r.reason) for r in experts if not r.fp4]
        assert report.moe and all("router not found" not in line for line in report.moe), report.moe
        routers = [r for r in rows if r.kind == "router"]
        assert routers and all(not r.fp4 and r.reason.startswith("router of") for r in routers), routers
        assert not any(r.fp4 and r.kind == "Linear" and r.name in {x.name for x in routers} for r in rows)

    model.train()
    loss = _loss(model, ids)
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item() - ref_loss.item()) < 0.01 * ref_loss.item(), \
        (loss.item(), ref_loss.item())
    ref_grads = {n for n, p in ref.named_parameters() if p.grad is not None}
    missing = [n for n, p in model.named_parameters() if n in ref_grads and p.grad is None]
    assert not missing, missing
    for name, m in model.named_modules():  # intercepted experts: every expert GEMM seen, none left BF16
        if isinstance(m, FP4InterceptedExperts):
            assert m.intercept is not None and not m.intercept["bf16"] and not m.intercept["unused"], (name,
                                                                                                      m.intercept)
