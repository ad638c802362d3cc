"""The probe's estimator: held-out predictions only (no leakage), and it learns what is linearly there."""

from __future__ import annotations

import torch

from ds_nvfp4.evaluation.linear_probe import cross_fitted


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


class _TinyGPT(torch.nn.Module):
    """The attributes :func:`linear_probe.features` reads (embed, pos, blocks, ln_f), at toy size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = torch.nn.Embedding(256, 8), torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        self.ln_f = torch.nn.LayerNorm(8)


def test_features_are_cached_per_checkpoint_and_examples(tmp_path) -> None:
    import os

    from ds_nvfp4.evaluation.linear_probe import cached_features

    (tmp_path / "ckpt").mkdir()
    latest = tmp_path / "ckpt" / "latest"
    latest.write_text("global_step10")
    loads = []

    def loader(run):
        loads.append(run)
        return _TinyGPT(), {}

    ex = [(b"cat: a small animal", 0), (b"run: move fast", 1), (b"red", 2)]
    first = cached_features(tmp_path, loader, ex, seq=16, progress=False)
    assert first.shape == (3, 3 * 8) and len(loads) == 1
    again = cached_features(tmp_path, loader, ex, seq=16, progress=False)
    assert len(loads) == 1 and torch.equal(again, first)  # from probe_features.pt, no forward pass
    cached_features(tmp_path, loader, ex[:2], seq=16, progress=False)
    assert len(loads) == 2  # other examples: recomputed
    st = latest.stat()
    os.utime(latest, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a newer checkpoint under the same tag
    cached_features(tmp_path, loader, ex[:2], seq=16, progress=False)
    assert len(loads) == 3
    assert not list(tmp_path.glob("*.tmp"))
