"""MoE experts under packed ZeRO-3 on 2 real ranks: every family's experts in NVFP4, experts as ZeRO-3 leaves."""

from __future__ import annotations

import math

import pytest
import torch

from tests.ranks import run_ranks
from tests.zero.engines import (
    config,
)


def scenario_families(rank: int, p: dict) -> dict:
    """Each transformers family of tests/integrations/families.py under plain ``deepspeed.initialize`` (the start-up
    hook), ZeRO-3 with packed storage, 3 steps: what was converted, storage, exactness of every packed weight
    (experts per expert matrix), losses."""
    import deepspeed

    import ds_nvfp4
    from ds_nvfp4.nn.module import FP4Module
    from tests.integrations.families import build

    out = {}
    for name in p["families"]:
        # every block FP4 here: the test is about which modules can be, not about the edge-block recipe
        cfg = config(preset="nvfp4_zero3.json", **{"precision.modules.keep_first_blocks_bf16": 0,
                                                  "precision.modules.keep_last_fraction_bf16": 0.0})
        model = build(name)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            ids = torch.randint(3, 256, (2, 16), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        block = engine.ds_nvfp4.precision.weights.block
        group_of = {n: g for g in engine.ds_nvfp4.conversion.fused_groups for n in g}
        exact = {}
        for mname, m in engine.module.named_modules():
            if not isinstance(m, FP4Module):
                continue
            for pname, param, codes in m.fp4_weights():
                if not engine.ds_nvfp4.store.entries[id(param)].packable:
                    continue
                master = deepspeed.utils.safe_get_full_fp32_param(param)
                if codes.stored_shape is not None:  # experts stacked in a 2-D parameter (DBRX): one matrix each
                    master = master.view(codes.stored_shape)
                with deepspeed.zero.GatheredParameters([param]):
                    seen = param.data.clone().view(master.shape)
                # one amax per expert matrix; a fused group's members (q, k, v) share the group's
                peers = [deepspeed.utils.safe_get_full_fp32_param(engine.module.get_submodule(n).weight)
                         for n in group_of.get(mname, [mname])] if master.dim() == 2 else [master]
                shared = torch.stack([w.abs().max() for w in peers]).max() if master.dim() == 2 else None
                mats = master if master.dim() == 3 else master[None]
                want = torch.stack([ds_nvfp4.quantize(w, block=block, amax=w.abs().max() if shared is None
                                                      else shared).dequantize(torch.bfloat16)
                                    for w in mats]).reshape(seen.shape)
                exact[f"{mname}.{pname}"] = bool(torch.equal(seen, want))
        rep = ds_nvfp4.storage_report(engine)
        out[name] = {"losses": losses, "exact": exact, "conversion": engine.ds_nvfp4.conversion.to_dict(),
                     "report": rep.to_dict(), "type": type(engine).__name__}
    return out


def scenario_reference_moe(rank: int, p: dict) -> dict:
    """The reference MoE GPT through ``ds_nvfp4.initialize`` with no leaf modules set by the caller: each rank routes
    its own tokens (few, so some experts get none and the ranks run different experts), in training and in eval
    forwards. Without ZeRO-3 leaf modules the ranks' module traces differ and they wait on each other forever."""
    import ds_nvfp4
    from ds_nvfp4.evaluation.gpt import GPT, model_spec

    torch.manual_seed(0)
    model = GPT.from_spec(model_spec("moe-1m"), 16)
    cfg = config(preset="nvfp4_zero3.json", **{"precision.schedule.bf16_warmup_steps": 0})
    engine, *_ = ds_nvfp4.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    hit, losses = [], []
    engine.module.blocks[1].moe.experts.register_forward_pre_hook(
        lambda m, args: hit.append(sorted(set(args[1].flatten().tolist()))))
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randint(0, 256, (1, 2 + 3 * rank), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).view(-1, 256), x.view(-1)) + 0.01 * engine.module.aux_loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.eval()
    with torch.no_grad():
        for i in range(4):
            g = torch.Generator().manual_seed(1000 + 10 * i + rank)
            engine(torch.randint(0, 256, (1, 1 + rank), generator=g))
    return {"losses": losses, "notes": engine.ds_nvfp4.conversion.notes, "hit": hit,
            "fp4_experts": [d["name"] for d in engine.ds_nvfp4.conversion.to_dict()["layers"]
                            if d["kind"] == "experts" and d["fp4"]]}


@pytest.mark.slow
@pytest.mark.parametrize("families", [["qwen2_moe", "qwen3_moe", "mixtral"], ["olmoe", "deepseek_v3", "gpt2"],
                                      ["gpt_oss", "dbrx", "llama4_text"]],
                         ids=["qwen2moe-qwen3moe-mixtral", "olmoe-deepseekv3-gpt2", "gptoss-dbrx-llama4"])
def test_moe_experts_and_conv1d_train_nvfp4_under_plain_deepspeed(families: list[str]) -> None:
    """Every expert matrix and every GPT-2 Conv1D in NVFP4 (packed ZeRO-3, exact per expert), routers BF16 with
    their reason, through an unmodified deepspeed.initialize call."""
    for r in run_ranks(scenario_families, families=families, timeout=900):
        for name in families:
            got = r[name]
            layers = got["conversion"]["layers"]
            kinds = {d["kind"] for d in layers if d["fp4"]}
            assert kinds == ({"Conv1D"} if name == "gpt2" else {"Linear", "experts"}), (name, kinds)
            experts = [d for d in layers if d["kind"] == "experts"]
            assert (name == "gpt2") == (not experts) and all(d["fp4"] and d["experts"] == 4 for d in experts), experts
            routers = [d for d in layers if d["kind"] == "router"]
            assert (name == "gpt2") == (not routers) and all(not d["fp4"] and "router" in d["reason"] for d in routers)
            packed = [n for n in got["exact"]]
            assert packed and all(got["exact"].values()), (name, got["exact"])
            if name != "gpt2":
                assert {d["name"] for d in experts} <= set(packed), (packed, experts)  # every expert weight packed
                assert got["report"]["packed_params"] >= len(packed)
            assert all(math.isfinite(v) for v in got["losses"]), got["losses"]


@pytest.mark.slow
def test_experts_become_zero3_leaf_modules_so_ranks_routing_differently_do_not_hang() -> None:
    """ds_nvfp4.initialize makes every experts module a ZeRO-3 leaf: ranks that run different experts (few tokens,
    per-rank data) train and evaluate to the end instead of waiting on each other (zero/leaves.py)."""
    res = run_ranks(scenario_reference_moe, timeout=240)
    # the case that hangs without leaf modules: some forward where the two ranks ran different sets of experts
    assert any(a != b for a, b in zip(res[0]["hit"], res[1]["hit"])), [r["hit"] for r in res]
    for r in res:
        assert r["finite"] and len(r["losses"]) == 3
        assert any("4 experts modules made leaf modules" in n for n in r["notes"]), r["notes"]
        assert r["fp4_experts"] == ["blocks.1.moe.experts.gate_up_proj", "blocks.1.moe.experts.down_proj",
                                    "blocks.2.moe.experts.gate_up_proj", "blocks.2.moe.experts.down_proj"]

