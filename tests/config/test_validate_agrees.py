"""`ds-nvfp4 validate` accepts a config exactly when `ds_nvfp4.initialize` does (one source of truth).

Over every shipped preset and a corpus of bad configs, on 2 real ranks. Machine- and model-dependent facts are
outside `validate` by design and not in the corpus: whether `precision.kernel` can run here (`ds-nvfp4 env
--config`), and whether `keep_*_blocks_bf16` fit the model.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from ds_nvfp4.config import check_config
from tests.ranks import run_ranks
from tests.zero.engines import ROOT, Net, config

pytestmark = pytest.mark.slow


def scenario_init_corpus(rank: int, p: dict) -> dict:
    """``ds_nvfp4.initialize`` on each named config: ``{name: None (ok) or "ErrorType: message"}``."""
    import ds_nvfp4

    out = {}
    for name, cfg in p["configs"].items():
        torch.manual_seed(0)
        model = Net()
        try:
            ds_nvfp4.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            out[name] = None
        except Exception as exc:  # the property compares success with validate, whatever the error type
            out[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"results": out}


PRESETS = sorted(p.name for p in (ROOT / "ds_configs").glob("*.json"))


def _set(d: dict, dotted: str, value) -> dict:
    d = copy.deepcopy(d)
    node = d
    *path, last = dotted.split(".")
    for k in path:
        node = node.setdefault(k, {})
    node[last] = value
    return d


BASE = config()
BAD = {
    # storage null (the presets) follows the stage; an explicit "nvfp4" below stage 3 is the error
    "storage nvfp4 at stage 2": _set(_set(BASE, "zero_optimization.stage", 2), "precision.weights.storage", "nvfp4"),
    "all_gather nvfp4 with bf16 storage": _set(_set(BASE, "precision.weights.storage", "bf16"),
                                               "precision.communication.all_gather", "nvfp4"),
    "fp4 backward with 1x16 weights": _set(_set(BASE, "precision.backward.gemm", "nvfp4"),
                                           "precision.weights.block", "1x16"),
    "fp16": _set(_set(BASE, "fp16", {"enabled": True}), "bf16.enabled", False),
    "no bf16": _set(BASE, "bf16.enabled", False),
    "qwZ": _set(BASE, "zero_optimization.zero_quantized_weights", True),
    "qwZ frozen": _set(BASE, "zero_optimization.zero_quantized_nontrainable_weights", True),
    "nvme params": _set(BASE, "zero_optimization.offload_param", {"device": "nvme", "nvme_path": "/tmp"}),
    "nvme optimizer": _set(BASE, "zero_optimization.offload_optimizer", {"device": "nvme", "nvme_path": "/tmp"}),
    "communication dtype disagrees": _set(BASE, "communication_data_type", "fp16"),
    "overflow check off": _set(BASE, "bf16.check_grad_overflow", False),
    "unknown precision key": _set(BASE, "precision.weights.storge", "nvfp4"),
    "auto in precision": _set(BASE, "precision.backward.gemm", "auto"),
    "bad deepspeed value": _set(BASE, "zero_optimization.stage", 7),
}
GOOD_VARIANTS = {
    "1x16 weights": _set(BASE, "precision.weights.block", "1x16"),
    "bf16 storage at stage 2": _set(_set(BASE, "zero_optimization.stage", 2), "precision.weights.storage", "bf16"),
    "precision disabled": _set(BASE, "precision.enabled", False),
}


def test_validate_accepts_exactly_what_initialize_accepts() -> None:
    corpus = {f"preset {name}": config(preset=name) for name in PRESETS} | BAD | GOOD_VARIANTS
    results = run_ranks(scenario_init_corpus, configs=corpus, timeout=600)[0]["results"]
    disagree = {}
    for name, cfg in corpus.items():
        _, problems = check_config(json.loads(json.dumps(cfg)), deepspeed_checks=True)
        valid = not [p for p in problems if p.severity == "error"]
        if valid != (results[name] is None):
            disagree[name] = {"validate": [p.format() for p in problems], "initialize": results[name]}
    assert disagree == {}, json.dumps(disagree, indent=1)
    assert all(results[f"preset {n}"] is None for n in PRESETS)
    assert all(results[n] is not None for n in BAD)
