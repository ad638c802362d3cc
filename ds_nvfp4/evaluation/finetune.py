"""Downstream check of the brief's 0.5% rule: fine-tune a pretrained run on an offline classification task.

``finetune(run_dir, task, seeds)`` rebuilds the run's GPT (:mod:`ds_nvfp4.evaluation.gpt`, shaped by its config.json),
loads the final checkpoint's FP32 master weights through DeepSpeed's ``zero_to_fp32`` reader, adds a linear
classifier over the mean-pooled final hidden states and fine-tunes every parameter in FP32 on one process, with
the same recipe and seeds for every run (so a BF16 and an NVFP4 pretraining are compared on equal terms).
Accuracy per seed on a fixed test split goes to ``RUN_DIR/finetune.json``; ``ds-nvfp4 compare`` pairs the two
runs' seeds and bootstraps the gap.

Tasks (installed by the project's set-up, nothing downloaded at run time):
- ``wordnet``: WordNet supersenses (Debian ``wordnet-base``): input ``"lemma: gloss"``, label one of 45 lexicographer
  files; 117,659 synsets, split 80/20 by a hash of the synset id. The only task here where 0.5 points is measurable.
- ``sentiment``: VADER movie-review sentences (PyPI sdist ``vaderSentiment==3.3.2``), label = sign of the mean rating.
"""

from __future__ import annotations

import base64
import hashlib
import json
import tarfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import GPT

WORDNET_DIR = Path("/usr/share/wordnet")
TASKS = ("wordnet", "sentiment")


class FinetuneError(ValueError):
    """Bad run directory, missing task data (says how to install it)."""


def _stable_fraction(key: str) -> float:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32


def wordnet_examples(root: Path = WORDNET_DIR) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
    """(train, test) lists of (``b"lemma: gloss"``, lexicographer file number 0..44)."""
    files = [root / f"data.{pos}" for pos in ("noun", "verb", "adj", "adv")]
    if not all(f.exists() for f in files):
        raise FinetuneError(f"WordNet data not found in {root}: install it with `apt-get install wordnet-base`")
    train, test = [], []
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue  # licence header
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            offset, lexfile, lemma = parts[0], int(parts[1]), parts[4].replace("_", " ")
            ex = (f"{lemma}: {gloss.strip()}".encode("ascii", "replace"), lexfile)
            (test if _stable_fraction(f"{f.name}:{offset}") < 0.2 else train).append(ex)
    return train, test


def sentiment_examples(cache: Path) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
    """VADER movie-review sentences with a binary label (sign of the mean of 20 human ratings)."""
    import subprocess
    import sys

    cache.mkdir(parents=True, exist_ok=True)
    sdists = list(cache.glob("vaderSentiment-3.3.2.*"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "vaderSentiment==3.3.2", "-d", str(cache)], check=True, timeout=600)
        sdists = list(cache.glob("vaderSentiment-3.3.2.*"))
    with tarfile.open(sdists[0]) as outer:
        inner = next(m for m in outer.getmembers() if m.name.endswith("hutto_ICWSM_2014.tar.gz"))
        with tarfile.open(fileobj=outer.extractfile(inner)) as tar:
            member = next(m for m in tar.getmembers() if "movieReviewSnippets_GroundTruth" in m.name)
            text = tar.extractfile(member).read().decode("latin-1")
    train, test = [], []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) < 3:
            continue
        ex = (parts[2].strip().encode("ascii", "replace"), int(float(parts[1]) > 0))
        (test if _stable_fraction(parts[0]) < 0.2 else train).append(ex)
    return train, test


def _encode(batch: list[tuple[bytes, int]], seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.zeros(len(batch), seq, dtype=torch.long)
    mask = torch.zeros(len(batch), seq)
    for i, (text, _) in enumerate(batch):
        b = list(text[:seq])
        x[i, :len(b)] = torch.tensor(b, dtype=torch.long)
        mask[i, :len(b)] = 1.0
    return x, mask, torch.tensor([y for _, y in batch])


class Classifier(nn.Module):
    """The pretrained GPT body, mean-pooled over real tokens, and a linear head."""

    def __init__(self, gpt: nn.Module, d: int, classes: int) -> None:
        super().__init__()
        self.gpt, self.head = gpt, nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        h = g.embed(x) + g.pos(torch.arange(x.shape[1]))
        for blk in g.blocks:
            h = blk(h)
        h = g.ln_f(h)
        pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return self.head(pooled)


def load_pretrained(run_dir: Path) -> tuple[nn.Module, dict]:
    """The run's GPT with its final FP32 master weights (DeepSpeed checkpoint in RUN_DIR/ckpt)."""
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists() or not (run_dir / "ckpt" / "latest").exists():
        raise FinetuneError(f"{run_dir}: needs config.json and ckpt/latest (a finished launch/train.py run)")
    config = json.loads(cfg_path.read_text())
    m = config["model"]
    gpt = GPT.from_spec(m, config["args"]["seq"])
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "ckpt"))
    sd.setdefault("lm_head.weight", sd["embed.weight"])
    gpt.load_state_dict({k: v.float() for k, v in sd.items()})
    return gpt, config


def lr_at(step: int, steps: int, lr: float, warmup: float = 0.1) -> float:
    """Linear warm-up over the first ``warmup`` fraction of the steps, then linear decay to 0.

    The decay matters for the 0.5-point rule: at a constant learning rate the last updates keep moving the model
    and two seeds of one checkpoint end several points apart (6.4 points measured at 200 constant-LR steps).
    """
    w = max(1, int(warmup * steps))
    return lr * (step + 1) / w if step < w else lr * max(0.0, (steps - step) / max(1, steps - w))


def pack_correct(correct: torch.Tensor) -> str:
    """Per-example correctness (bool ``[N]``) as base64 of its bits (numpy ``packbits`` order).

    ``ds_nvfp4.evaluation.acceptance.unpack_correct`` reads it back.
    """
    import numpy as np

    return base64.b64encode(np.packbits(correct.numpy().astype(np.uint8)).tobytes()).decode()


def examples_fingerprint(test: list[tuple[bytes, int]]) -> str:
    """sha256 over the test examples in order: ``compare`` pairs per-example results only on equal test sets."""
    h = hashlib.sha256()
    for text, label in test:
        h.update(text + b"\x00" + str(label).encode() + b"\n")
    return h.hexdigest()


def finetune(run_dir: str | Path, task: str = "wordnet", seeds: tuple[int, ...] = (0, 1, 2, 3), steps: int = 400,
             batch: int = 32, seq: int = 64, lr: float = 3e-4, test_examples: int | None = None,
             data: tuple[list, list] | None = None, progress: bool = True) -> dict:
    """Fine-tune once per seed and write ``RUN_DIR/finetune.json``; returns its content.

    ``test_examples`` None evaluates the whole test split (WordNet: ~23.5k examples, paired SE of a gap ~0.3
    points); a number takes a fixed random subset (same for every run and seed). Besides the accuracy per seed the
    file holds each seed's per-example correctness (``correct``, see :func:`pack_correct`) so ``compare`` can
    bootstrap over test examples as well as seeds.
    """
    if task not in TASKS:
        raise FinetuneError(f"--task {task!r}: allowed values are {', '.join(TASKS)}")
    if steps < 1 or batch < 1:
        raise FinetuneError(f"--steps {steps} --batch {batch}: both must be >= 1")
    run = Path(run_dir)
    train, test = data or (wordnet_examples() if task == "wordnet" else sentiment_examples(run / ".." / ".cache"))
    if test_examples is not None and test_examples < len(test):
        gen = torch.Generator().manual_seed(1234)  # the same test subset for every run and seed
        test = [test[i] for i in torch.randperm(len(test), generator=gen)[:test_examples].tolist()]
    classes = max(y for _, y in train + test) + 1
    accuracies, corrects = [], []
    for seed in seeds:
        gpt, config = load_pretrained(run)
        torch.manual_seed(seed)
        model = Classifier(gpt, config["model"]["d_model"], classes)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        order = torch.Generator().manual_seed(seed)
        it = range(steps)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, desc=f"{run.name} {task} seed {seed}", unit="step", leave=False)
        for step in it:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr)
            idx = torch.randint(len(train), (batch,), generator=order).tolist()
            x, mask, y = _encode([train[i] for i in idx], seq)
            loss = F.cross_entropy(model(x, mask), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        correct = []
        with torch.inference_mode():
            for i in range(0, len(test), 512):
                x, mask, y = _encode(test[i:i + 512], seq)
                correct.append(model(x, mask).argmax(-1) == y)
        correct = torch.cat(correct)
        accuracies.append(int(correct.sum()) / len(correct))
        corrects.append(pack_correct(correct))
    result = {"task": task, "seeds": list(seeds), "accuracy": accuracies, "steps": steps, "batch": batch,
              "lr": lr, "lr_schedule": "linear warm-up 10%, linear decay to 0", "seq": seq,
              "train_examples": len(train), "test_examples": len(test), "test_sha256": examples_fingerprint(test),
              "correct": corrects,
              "recipe": "FP32 fine-tune of every parameter from the FP32 master weights, mean-pooled linear head"}
    (run / "finetune.json").write_text(json.dumps(result, indent=2))
    return result


__all__ = ["TASKS", "FinetuneError", "examples_fingerprint", "finetune", "load_pretrained", "lr_at", "pack_correct",
           "sentiment_examples", "wordnet_examples"]
