"""Downstream check without seed noise: a linear probe on a pretrained run's frozen features.

``probe(run_dir, task)`` loads the run's final FP32 master weights (as ``finetune`` does), runs the
frozen GPT once over a fixed set of labelled examples and keeps, per example, the mean over its real tokens of the
hidden state after every block and after the final norm (``(layers + 1) * d_model`` features: what each depth
knows). A multinomial logistic regression (L2, full-batch L-BFGS, standardized features) is then cross-fitted over
``folds`` folds, so every example is predicted by a probe that never saw it. Nothing is random after the example
subset is drawn (same seed for every run): the probe accuracy is a function of the checkpoint, so two runs differ
only by what they learned, and ``ds-nvfp4 compare`` bootstraps the gap over examples (one level, no seeds).

Why: fine-tuning seeds of one checkpoint end ~2 points apart on WordNet, so a 0.5-point rule needs ~16 seeds per
run (~70 min each here); the probe needs one forward pass per example (cached in ``RUN_DIR/probe_features.pt``)
and its interval is set by the number of examples: all 117,659 of WordNet give +-0.21 points at 5M.
Result: ``RUN_DIR/probe.json`` (accuracy, per-example correctness packed as in ``finetune.json``, settings).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .finetune import FinetuneError, _encode, examples_fingerprint, load_pretrained, pack_correct, wordnet_examples

#: what probe.json records of its settings; ``compare`` pairs two probes only when these agree
SETTINGS = ("task", "examples", "folds", "seq", "l2", "iterations", "examples_sha256")


@torch.inference_mode()
def features(gpt: torch.nn.Module, examples: list[tuple[bytes, int]], seq: int = 64, batch: int = 256,
             progress: bool = True) -> torch.Tensor:
    """``[N, (layers + 1) * d]`` float32: per example, the masked mean over tokens of every block's output and of
    the final norm's output (the frozen model in FP32, eval mode)."""
    gpt.eval()
    out = []
    it = range(0, len(examples), batch)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="probe features", unit="batch", leave=False)
    for i in it:
        x, mask, _ = _encode(examples[i:i + batch], seq)
        w = (mask / mask.sum(1, keepdim=True).clamp(min=1)).unsqueeze(-1)
        h = gpt.embed(x) + gpt.pos(torch.arange(x.shape[1]))
        pooled = []
        for blk in gpt.blocks:
            h = blk(h)
            pooled.append((h * w).sum(1))
        pooled.append((gpt.ln_f(h) * w).sum(1))
        out.append(torch.cat(pooled, 1).float())
    return torch.cat(out)


def fit_predict(x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, classes: int,
                l2: float = 1e-3, iterations: int = 100) -> torch.Tensor:
    """Multinomial logistic regression on standardized features (statistics of the training part only), L2
    ``l2`` on the weights, full-batch L-BFGS for ``iterations`` iterations from zero. Returns predicted labels of
    ``x_test`` (``[M]`` int64). Deterministic: no random initialisation, no sampling."""
    mean, std = x_train.mean(0), x_train.std(0).clamp(min=1e-6)
    a, b = (x_train - mean) / std, (x_test - mean) / std
    w = torch.zeros(a.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, bias], lr=1.0, max_iter=iterations, history_size=20,
                            line_search_fn="strong_wolfe", tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(a @ w + bias, y_train) + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        return (b @ w + bias).argmax(1)


def cross_fitted(feats: torch.Tensor, labels: torch.Tensor, classes: int, folds: int = 5, l2: float = 1e-3,
                 iterations: int = 100) -> torch.Tensor:
    """Per-example correctness (bool ``[N]``) of probes each fitted on all folds but the example's own (fold =
    position mod ``folds``)."""
    pred = torch.empty_like(labels)
    fold = torch.arange(len(labels)) % folds
    for k in range(folds):
        held = fold == k
        pred[held] = fit_predict(feats[~held], labels[~held], feats[held], classes, l2, iterations)
    return pred == labels


def cached_features(run: Path, gpt_loader, chosen: list[tuple[bytes, int]], seq: int,
                    progress: bool = True) -> torch.Tensor:
    """:func:`features` of ``chosen``, kept in ``RUN_DIR/probe_features.pt`` so a second probe of the same run (other
    folds or L2) skips the forward passes, the expensive part (~20 min for all 117,659 examples at 5M parameters
    on 2 shared cores). The cache is used only for the same examples (fingerprint), ``seq`` and checkpoint
    (``ckpt/latest`` tag and its modification time); anything else recomputes and replaces it."""
    latest = run / "ckpt" / "latest"
    key = {"examples_sha256": examples_fingerprint(chosen), "seq": seq,
           "checkpoint": f"{latest.read_text().strip()}@{latest.stat().st_mtime_ns}"}
    path = run / "probe_features.pt"
    if path.exists():
        saved = torch.load(path, map_location="cpu")
        if saved.get("key") == key:
            return saved["features"]
    gpt, _ = gpt_loader(run)
    feats = features(gpt, chosen, seq, progress=progress)
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "features": feats}, tmp)
    tmp.replace(path)  # never a half-written cache
    return feats


def probe(run_dir: str | Path, task: str = "wordnet", examples: int | None = None, folds: int = 5, seq: int = 64,
          l2: float = 1e-3, iterations: int = 100, data: tuple[list, list] | None = None,
          progress: bool = True) -> dict:
    """Cross-fitted linear probe of ``run_dir``'s final checkpoint; writes and returns ``RUN_DIR/probe.json``.

    ``examples``: a fixed random subset of the task's train+test examples (the same for every run; all of them
    when None or larger than the task), split into ``folds`` folds by position in that subset. All of WordNet
    (117,659) is what a 0.5-point verdict needs at a ~0.15-point gap (docs/results.md): the paired interval's
    half-width is ~1.96 sqrt(disagreement / N).
    """
    if task != "wordnet":
        raise FinetuneError(f"--task {task!r}: the probe supports wordnet (45 classes, enough examples for a "
                            "0.5-point interval)")
    if folds < 2 or (examples is not None and examples < folds):
        raise FinetuneError(f"--folds {folds} --examples {examples}: need folds >= 2 and examples >= folds")
    run = Path(run_dir)
    train, test = data or wordnet_examples()
    pool = train + test
    gen = torch.Generator().manual_seed(1234)  # the same subset and order for every run
    pick = torch.randperm(len(pool), generator=gen)[:examples].tolist()  # [:None]: all
    chosen = [pool[i] for i in pick]
    labels = torch.tensor([y for _, y in chosen])
    classes = max(y for _, y in pool) + 1
    t0 = time.perf_counter()
    feats = cached_features(run, load_pretrained, chosen, seq, progress)
    blocks = json.loads((run / "config.json").read_text())["model"]["layers"]
    t_feat = time.perf_counter() - t0
    correct = cross_fitted(feats, labels, classes, folds, l2, iterations)
    result = {"task": task, "examples": len(chosen), "folds": folds, "seq": seq, "l2": l2, "iterations": iterations,
              "examples_sha256": examples_fingerprint(chosen),
              "features": f"masked token mean after each of {blocks} blocks and the final norm ({feats.shape[1]} "
                          "per example)",
              "accuracy": int(correct.sum()) / len(chosen), "correct": pack_correct(correct),
              "seconds": {"features": round(t_feat, 1), "total": round(time.perf_counter() - t0, 1)},
              "method": "cross-fitted multinomial logistic regression on frozen FP32 features (deterministic)"}
    (run / "probe.json").write_text(json.dumps(result, indent=2))
    return result


__all__ = ["SETTINGS", "cross_fitted", "features", "fit_predict", "probe"]
