"""The probe's estimator: held-out predictions only (no leakage), and it learns what is linearly there."""

from __future__ import annotations

import torch

from ds_nvfp4.probe import cross_fitted


def test_cross_fitting_never_predicts_an_example_with_a_probe_that_saw_it() -> None:
    # random labels on 300 random 200-dim features: a probe that saw the example memorises it (near 100%); an
    # honest held-out prediction is at chance (1/5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 200, generator=g)
    y = torch.randint(0, 5, (300,), generator=g)
    acc = cross_fitted(x, y, 5, folds=5, l2=1e-4, iterations=50).float().mean()
    assert acc < 0.32, acc


def test_linearly_separable_labels_are_learned() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2000, 32, generator=g) * torch.linspace(0.1, 10, 32)  # unequal scales: standardization matters
    w = torch.randn(32, 7, generator=g)
    y = ((x / torch.linspace(0.1, 10, 32)) @ w).argmax(1)
    acc = cross_fitted(x, y, 7, folds=4, l2=1e-4, iterations=100).float().mean()
    assert acc > 0.9, acc
