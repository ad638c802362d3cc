"""`ds_nvfp4.initialize` and the start-up hook on 2 real ranks: the config from args, plain DeepSpeed when
disabled, an unmodified `deepspeed.initialize` routed to ds_nvfp4."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.ranks import run_ranks
from tests.zero.engines import (
    ROOT,
    Net,
    batch,
    config,
    exactness,
    train,
)


def scenario_args_form(rank: int, p: dict) -> dict:
    """`deepspeed --deepspeed_config FILE` style: the config comes from args; a BF16 preset is plain DeepSpeed."""
    import argparse

    import ds_nvfp4
    from ds_nvfp4.nn import NVFP4Linear

    out = {}
    for preset in ("nvfp4_zero3.json", "bf16_zero3.json"):
        torch.manual_seed(0)
        model = Net()
        args = argparse.Namespace(deepspeed_config=str(ROOT / "ds_configs" / preset), local_rank=rank)
        engine, *_ = ds_nvfp4.initialize(args=args, model=model, model_parameters=model.parameters())
        loss = engine(*batch(0, rank))
        engine.backward(loss)
        engine.step()
        out[preset] = {"has_state": hasattr(engine, "ds_nvfp4"),
                       "fp4_layers": sum(isinstance(m, NVFP4Linear) for m in engine.module.modules()),
                       "loss": float(loss), "report": bool(ds_nvfp4.storage_report(engine))}
    return out


def scenario_plain_deepspeed(rank: int, p: dict) -> dict:
    """An unmodified script: model built under ``deepspeed.zero.Init``, then plain ``deepspeed.initialize``.

    The start-up hook (ds_nvfp4_autohook.pth) must route it to ds_nvfp4 when the config has a ``precision``
    section, refuse an invalid section, and leave DeepSpeed alone without one or with ``DS_NVFP4_AUTO=0``.
    """
    import deepspeed

    from ds_nvfp4.config import ConfigError

    def build(cfg: dict) -> nn.Module:
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            return Net()

    out: dict = {"wrapped": hasattr(deepspeed.initialize, "__ds_nvfp4_original__")}
    cfg = config()
    model = build(cfg)
    out["partitioned_at_construction"] = all(hasattr(q, "ds_id") and q.numel() == 0
                                             for q in model.blocks[0].fc1.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out["has_state"] = hasattr(engine, "ds_nvfp4")
    out["losses"] = train(engine, range(4), rank)
    rep = engine.ds_nvfp4.store.report() if out["has_state"] and engine.ds_nvfp4.store else None
    out["report"] = rep.to_dict() if rep else None
    out["exact"] = exactness(engine) if out["has_state"] else {}
    import argparse

    import ds_nvfp4

    # the most common call: deepspeed.initialize(args=cmd_args, model=...) with args.deepspeed_config, no config=
    path = Path(p["dir"]) / f"ds_rank{rank}.json"
    path.write_text(json.dumps(config()))
    by_args, *_ = deepspeed.initialize(args=argparse.Namespace(deepspeed_config=str(path), local_rank=rank),
                                       model=build(cfg))
    out["args_keyword_state"] = hasattr(by_args, "ds_nvfp4")
    explicit, *_ = ds_nvfp4.initialize(model=build(cfg), config=config())
    out["explicit_losses"] = train(explicit, range(4), rank)

    bad = config()
    bad["precision"]["weights"] = {"storage": "fp8"}
    try:
        deepspeed.initialize(model=Net(), model_parameters=Net().parameters(), config=bad)
        out["invalid"] = "no error"
    except ConfigError as exc:
        out["invalid"] = str(exc)

    plain = config()
    del plain["precision"]
    e2, *_ = deepspeed.initialize(model=build(plain), config=plain)
    out["no_section_state"] = hasattr(e2, "ds_nvfp4")
    typo = config()
    typo["precison"] = typo.pop("precision")  # DeepSpeed ignores it: a BF16 run, said loudly on rank 0
    import contextlib
    import io

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        e4, *_ = deepspeed.initialize(model=build(typo), config=typo)
    out["typo_state"], out["typo_said"] = hasattr(e4, "ds_nvfp4"), said.getvalue()
    os.environ["DS_NVFP4_AUTO"] = "0"
    e3, *_ = deepspeed.initialize(model=build(cfg), config=config())
    out["opt_out_state"] = hasattr(e3, "ds_nvfp4")
    return out


@pytest.mark.slow
def test_config_from_args_and_plain_deepspeed_when_disabled() -> None:
    for r in run_ranks(scenario_args_form):
        nv, bf = r["nvfp4_zero3.json"], r["bf16_zero3.json"]
        # the default preset keeps the first and the last of the 3 blocks BF16: blocks.1's two Linears, odd and mix
        assert nv["has_state"] and nv["fp4_layers"] == 4 and nv["report"]
        assert not bf["has_state"] and bf["fp4_layers"] == 0 and not bf["report"]
        assert math.isfinite(nv["loss"]) and math.isfinite(bf["loss"])


@pytest.mark.slow
def test_unmodified_deepspeed_initialize_with_zero_init_model_trains_nvfp4(tmp_path) -> None:
    """The contract of the start-up hook, on 2 real ranks: plain ``deepspeed.initialize`` honours ``precision``."""
    for r in run_ranks(scenario_plain_deepspeed, dir=str(tmp_path)):
        assert r["wrapped"], "ds_nvfp4_autohook.pth did not wrap deepspeed.initialize (is the package installed?)"
        assert r["partitioned_at_construction"]
        assert r["has_state"] and r["report"]["packed_params"] > 0 and r["report"]["ratio"] < 0.3
        assert r["exact"] and all(x["equal"] for x in r["exact"].values() if x["packed"])
        assert r["finite"] and r["losses"] == r["explicit_losses"]  # exactly what ds_nvfp4.initialize does
        assert "precision.weights.storage" in r["invalid"] and '"fp8"' in r["invalid"]
        assert not r["no_section_state"] and not r["opt_out_state"]
        assert r["args_keyword_state"], "deepspeed.initialize(args=..., model=...) was not routed to ds_nvfp4"
        assert not r["typo_state"]
        said = "'precison': DeepSpeed ignores unknown keys, so this run trains WITHOUT NVFP4"
        assert (said in r["typo_said"]) == (r["rank"] == 0), r["typo_said"]  # loudly, once (rank 0)

