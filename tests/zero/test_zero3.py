"""Real 2-rank ZeRO-3 runs (gloo, CPU): packed storage, exactness, gathers, universal checkpoints, DeepSpeed
features."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from tests.ranks import run_ranks
from tests.zero.engines import (
    config,
    digests,
    exactness,
    make_engine,
    scenario_save,
    scenario_train,
    train,
)

pytestmark = pytest.mark.slow


def scenario_modify(rank: int, p: dict) -> dict:
    """GatheredParameters(modifier_rank=0): unchanged weights keep their bytes; changed ones are re-packed."""
    import deepspeed

    import ds_nvfp4

    engine = make_engine(config())
    store = engine.ds_nvfp4.store
    w = engine.module.blocks[0].fc1.weight
    e = store.entries[id(w)]
    def snapshot():
        return e.q.wire().clone(), e.codes.agreed_amax.clone()

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    before = snapshot()
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        pass
    kept = same(snapshot(), before)
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        if rank == 0:
            w.data[0, :16] = 1.0  # an outlier: new amax, new codes everywhere
        full_new = w.data.clone()
    torch.distributed.broadcast(full_new, src=0)  # what every rank holds after the context's broadcast
    with deepspeed.zero.GatheredParameters([w]):
        seen = w.data.clone()
    want = ds_nvfp4.quantize(full_new.float(), block="16x16", amax=full_new.float().abs().max()).dequantize()
    return {"kept_bytes": kept, "changed_bytes": not same(snapshot(), before),
            "repacked_equal": bool(torch.equal(seen, want))}


def scenario_load_universal(rank: int, p: dict) -> dict:
    """Load a universal checkpoint written by another number of ranks, check the masters, train on."""
    import deepspeed

    e = make_engine(config(**{"checkpoint.load_universal": True}), seed=321)
    e.load_checkpoint(p["dir"], tag=p["tag"])
    w = {n: float(deepspeed.utils.safe_get_full_fp32_param(q).double().sum()) for n, q in e.module.named_parameters()}
    d = digests(e)
    losses = train(e, range(3, 5), rank)
    return {"losses": losses, "w": w, "d": d, "exact": exactness(e)}


def scenario_fused(rank: int, p: dict) -> dict:
    """``modules.fuse: [["fc1", "fc2"]]``: each block's fc1/fc2 share one amax (packed store), or are unfused with
    a note (ZeRO-3 with BF16 storage). Reports, per layer, whether the forward's weight equals the quantized
    master with the group's amax and with its own."""
    import deepspeed

    import ds_nvfp4

    cfg = config(**{"precision.modules.fuse": [["fc1", "fc2"]], **p.get("config", {})})
    engine = make_engine(cfg)
    train(engine, range(2), rank)
    state = engine.ds_nvfp4
    masters = {n: deepspeed.utils.safe_get_full_fp32_param(m.weight) for n, m in engine.module.named_modules()
               if n.endswith((".fc1", ".fc2"))}
    out: dict = {"fused_groups": state.conversion.fused_groups, "notes": state.conversion.notes, "layers": {}}
    for name, master in masters.items():
        m = engine.module.get_submodule(name)
        peer = masters[name[:-1] + ("2" if name.endswith("1") else "1")]
        with deepspeed.zero.GatheredParameters([m.weight]):
            seen = m.weight.data.clone()

        def q(amax, w=master):
            return ds_nvfp4.quantize(w, block="16x16", amax=amax).dequantize(torch.bfloat16)

        out["layers"][name] = {"group": bool(torch.equal(seen, q(torch.maximum(master.abs().max(),
                                                                               peer.abs().max())))),
                               "own": bool(torch.equal(seen, q(master.abs().max())))}
    return out


def scenario_comm_dtype(rank: int, p: dict) -> dict:
    """The dtype DeepSpeed's engine reduce-scatters gradients in, for each precision.communication.reduce_scatter."""
    out = {}
    for rs in ("bf16", "fp32"):
        engine = make_engine(config(**{"precision.communication.reduce_scatter": rs}))
        out[rs] = str(engine.communication_data_type)
        train(engine, range(1), rank)
    return out


def scenario_traffic(rank: int, p: dict) -> dict:
    """Per configuration: the payload each collective moved in one step (counted by wrapping torch.distributed)
    and ds_nvfp4.zero.traffic's analytic bytes. With DeepSpeed's default live/prefetch limits this small model is
    gathered whole once per step (one pass)."""
    from bench import comm_count
    from ds_nvfp4.zero.traffic import engine_traffic

    out = {}
    for name, over in {"bf16": {"preset": "bf16_zero3.json"}, "nvfp4_bf16_gather": {},
                       "nvfp4_nvfp4_gather": {"precision.communication.all_gather": "nvfp4"},
                       "nvfp4_fp32_rs": {"precision.communication.all_gather": "nvfp4",
                                         "precision.communication.reduce_scatter": "fp32",
                                         "communication_data_type": "fp32"}}.items():
        engine = make_engine(config(**over))
        train(engine, range(2), rank)
        comm_count.reset()
        train(engine, range(2, 3), rank)
        out[name] = {"counted": comm_count.by_family(), "analytic": engine_traffic(engine).as_dict()}
    return out


def scenario_variants(rank: int, p: dict) -> dict:
    """Several configs in one launch (process start-up dominates on 2 cores): per variant, exactness before and
    after training, losses, storage report; with ``save``, the first variant is checkpointed (tag step3)."""
    out = {}
    for i, (name, overrides) in enumerate(p["variants"].items()):
        engine = make_engine(config(**overrides))
        before = exactness(engine)
        losses = train(engine, range(p.get("steps", 3)), rank)
        rep = engine.ds_nvfp4.store.report()
        out[name] = {"before": before, "after": exactness(engine), "losses": losses, "report": rep.to_dict()}
        if i == 0 and p.get("save"):
            engine.save_checkpoint(p["save"], tag="step3")
            out[name]["d"] = digests(engine)
    return out


@pytest.fixture(scope="module")
def bf16_gather() -> list[dict]:
    return run_ranks(scenario_train, steps=6)


def test_forward_weights_equal_quantized_master_bit_for_bit(bf16_gather) -> None:
    for r in bf16_gather:
        for when in ("before", "after"):
            res = r[when]
            assert res and all(v["packed"] for k, v in res.items() if k != "odd"), res
            assert all(v["equal"] for v in res.values() if v["packed"]), (when, res)
        assert r["kernel"] == "emulated"


def test_storage_is_packed_and_reported(bf16_gather) -> None:
    for r in bf16_gather:
        rep = r["report"]
        assert rep["packed_params"] == 7  # 3 blocks x 2 + mix
        assert rep["ratio"] <= 0.29 and rep["packed_bytes"] > 0
        assert "odd.weight" in rep["kept_bf16"] and "cuts a 16x16 tile" in rep["kept_bf16"]["odd.weight"]
        assert r["finite"] and len(set(r["losses"])) > 1
        notes = " ".join(r["conversion"]["notes"])
        assert "odd.weight: FP4 GEMMs, but its ZeRO-3 partition is stored BF16" in notes


def test_nvfp4_all_gather_gives_the_same_bits(bf16_gather) -> None:
    nvfp4 = run_ranks(scenario_train, steps=6, config={"precision.communication.all_gather": "nvfp4"})
    for a, b in zip(bf16_gather, nvfp4):
        assert a["losses"] == b["losses"]  # same gathered weights -> same computation, bit for bit
        assert {k: v["checksum"] for k, v in a["after"].items()} == {k: v["checksum"] for k, v in b["after"].items()}
        assert all(v["equal"] for v in b["after"].values() if v["packed"])
        ratio = b["report"]["gathered_bytes"] / a["report"]["gathered_bytes"]
        assert 0.25 < ratio < 0.30, ratio
        # the codes arrive as codes: layers stored packed reuse them (no quantization; same bits, asserted above),
        # those stored BF16 (odd: a partition cuts its tiles) quantize their gathered weight as with bf16 gathers
        packed = {n for n, v in b["after"].items() if v["packed"]}
        assert packed and all(b["weight_quantizations"][n] == 0 for n in packed), b["weight_quantizations"]
        assert all(a["weight_quantizations"][n] > 0 for n in a["weight_quantizations"])
        assert all(b["weight_quantizations"][n] > 0 for n in b["weight_quantizations"] if n not in packed)


@pytest.mark.parametrize("gather", ["bf16", "nvfp4"])
def test_4over6_weights_are_stored_gathered_and_multiplied_bit_for_bit(gather: str) -> None:
    """precision.weights.scaling "4over6": the packed partitions hold the 4/6 codes of the FP32 master (bound 256),
    both gathers deliver them, and the forward multiplies exactly them (not the standard quantization)."""
    res = run_ranks(scenario_train, steps=4, config={"precision.weights.scaling": "4over6",
                                              "precision.communication.all_gather": gather})
    for r in res:
        for when in ("before", "after"):
            packed = {n: v for n, v in r[when].items() if v["packed"]}
            assert packed and all(v["equal"] for v in packed.values()), (when, r[when])
            assert not all(v["standard"] for v in packed.values())  # 4/6 chose map-to-4 somewhere
        assert r["finite"] and "4/6 scaling (bound 256, MAE)" in r["recipe"]
        if gather == "nvfp4":
            assert all(r["weight_quantizations"][n] == 0 for n in packed)  # the gathered 4/6 codes were reused


def test_gathered_parameters_with_modifier_rank() -> None:
    for r in run_ranks(scenario_modify):
        assert r["kept_bytes"], "an unmodified weight must keep its packed bytes"
        assert r["changed_bytes"] and r["repacked_equal"], r


def test_offload_optimizer_gradient_accumulation_and_clipping() -> None:
    res = run_ranks(scenario_train, steps=4, config={"zero_optimization.offload_optimizer": {"device": "cpu"},
                                              "zero_force_ds_cpu_optimizer": False, "gas": 2,
                                              "gradient_clipping": 0.5})
    for r in res:
        assert r["finite"] and r["report"]["packed_params"] == 7
        assert all(v["equal"] for v in r["after"].values() if v["packed"])
        # safe_get_full_grad of the packed weights: the full [out, in] gradient, finite, not all zero
        assert r["grads"] and all(g["shape"] == r["weight_shapes"][n] and g["finite"] and g["norm"] > 0
                                  for n, g in r["grads"].items()), r["grads"]


def test_zero2_converts_but_stores_bf16() -> None:
    res = run_ranks(scenario_train, steps=3, config={"preset": "nvfp4_zero2.json"})
    for r in res:
        assert r["report"] is None and r["finite"]
        assert any(layer["fp4"] for layer in r["conversion"]["layers"])


def _to_universal(ckpt, tag: str) -> str:
    import subprocess

    out = f"{ckpt}/{tag}_universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    f"{ckpt}/{tag}", "--output_folder", out, "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   check=True, timeout=300, capture_output=True)
    return f"{tag}_universal"


@pytest.mark.parametrize("save_ranks, load_ranks", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_ranks(tmp_path, save_ranks: int, load_ranks: int) -> None:
    ckpt = tmp_path / "ckpt"
    saved = run_ranks(scenario_save, world_size=save_ranks, dir=str(ckpt))[0]
    tag = _to_universal(ckpt, "step3")
    for r in run_ranks(scenario_load_universal, world_size=load_ranks, dir=str(ckpt), tag=tag):
        assert r["d"] == saved["d"]  # every FP32 master through the universal checkpoint, bit for bit
        assert r["finite"] and all(x["equal"] for x in r["exact"].values() if x["packed"])


def test_no_shared_memory_left_behind(bf16_gather) -> None:
    """DeepSpeed's CPU shm all-reduce leaks a 69 MB /dev/shm segment per rank and run; initialize unlinks it."""
    for r in bf16_gather:
        assert r["shm_segment"] == {"created": True, "left_behind": False}
        assert r["finite"]  # the all-reduces after the unlink still worked (the mapping outlives the name)
        assert r["exit_teardown"]  # gloo groups destroyed at exit (zero/teardown.py; tests/zero/test_teardown.py)


@pytest.mark.parametrize("override", [{"zero_optimization.offload_param": {"device": "cpu"}},
                                      {"zero_optimization.zero_hpz_partition_size": 2}],
                         ids=["offload_param", "hpz"])
def test_offload_param_and_hpz(override: dict, bf16_gather) -> None:
    res = run_ranks(scenario_train, steps=3, config=override)
    for r, ref in zip(res, bf16_gather):
        assert r["report"]["packed_params"] == 7
        assert all(v["equal"] for v in r["after"].values() if v["packed"])
        assert r["losses"] == ref["losses"][:3]  # same numbers as the plain ZeRO-3 run


def test_fused_groups_share_one_amax_in_the_packed_store_and_are_unfused_with_bf16_storage() -> None:
    r0 = run_ranks(scenario_fused)[0]
    assert r0["fused_groups"] == [[f"blocks.{i}.fc1", f"blocks.{i}.fc2"] for i in range(3)]
    assert all(v["group"] for v in r0["layers"].values()), r0["layers"]
    assert not all(v["own"] for v in r0["layers"].values())  # the shared amax is not each layer's own
    r0 = run_ranks(scenario_fused, config={"precision.weights.storage": "bf16"})[0]
    assert r0["fused_groups"] == []
    assert sum("does not share an amax: ZeRO-3 with weights.storage" in n for n in r0["notes"]) == 3, r0["notes"]


def test_reduce_scatter_fp32_sets_deepspeeds_communication_data_type() -> None:
    for r in run_ranks(scenario_comm_dtype):
        assert r["fp32"] == "torch.float32" and r["bf16"] == "torch.bfloat16", r


def _all_exact(v: dict) -> bool:
    return all(x["equal"] for when in ("before", "after") for x in v[when].values() if x["packed"])


def test_four_ranks_blocks_hpz_and_a_universal_checkpoint_to_two(tmp_path) -> None:
    """4 ranks: 16x16 (odd's 12-row partitions cut tiles: BF16, reported), 1x16 under ZeRO-3 (odd packs too),
    hpZ with a secondary group of 2 in a world of 4 (same numbers as plain ZeRO-3); then the 16x16 run's
    checkpoint, made universal, loads on 2 ranks with every FP32 master bit for bit."""
    variants = {"16x16": {}, "1x16": {"precision.weights.block": "1x16"},
                "hpz2": {"zero_optimization.zero_hpz_partition_size": 2}}
    ckpt = tmp_path / "ckpt"
    res = run_ranks(scenario_variants, world_size=4, variants=variants, save=str(ckpt), timeout=900)
    for r in res:
        a, b, h = r["16x16"], r["1x16"], r["hpz2"]
        assert a["report"]["packed_params"] == 7 and "cuts a 16x16 tile" in a["report"]["kept_bf16"]["odd.weight"]
        assert b["report"]["packed_params"] == 8 and b["report"]["kept_bf16"] == {}
        assert h["report"]["packed_params"] == 7 and h["losses"] == a["losses"]
        assert all(_all_exact(v) for v in (a, b, h)) and all(math.isfinite(x) for x in a["losses"] + b["losses"])
        assert all(v["packed"] for v in b["after"].values())
    tag = _to_universal(ckpt, "step3")
    for r in run_ranks(scenario_load_universal, world_size=2, dir=str(ckpt), tag=tag):
        assert r["d"] == res[0]["16x16"]["d"]  # 4 -> 2 ranks, every tensor bit for bit
        assert r["finite"] and all(x["equal"] for x in r["exact"].values() if x["packed"])


def test_three_ranks_pad_partitions_which_are_stored_bf16_and_reported() -> None:
    for r in run_ranks(scenario_train, world_size=3, steps=2):
        kept = r["report"]["kept_bf16"]
        assert "do not split evenly over 3 ranks" in kept["blocks.0.fc1.weight"], kept  # 16384 % 3 != 0
        assert r["finite"] and all(v["equal"] for v in r["after"].values() if v["packed"])
        assert r["report"]["packed_params"] + r["report"]["bf16_params"] > 0


def test_the_bytes_each_collective_moves_are_the_analytic_bytes():
    """What ``ds-nvfp4 explain`` / the start-up line / docs/scaling.md say a step moves is what it moves: the
    collectives of one real 2-rank step, counted by wrapping torch.distributed, against ds_nvfp4.zero.traffic (one
    gather pass: DeepSpeed keeps this small model gathered from the forward to the backward)."""
    r = run_ranks(scenario_traffic, count_collectives=True)[0]
    for name, got in r.items():
        if name in ("rank", "shm_segment", "exit_teardown", "finite"):
            continue
        a = got["analytic"]
        assert got["counted"]["all_gather"]["bytes"] == a["gather_bytes_per_pass"], name
        assert got["counted"]["reduce_scatter"]["bytes"] == a["reduce_scatter_bytes"], name
    assert r["nvfp4_nvfp4_gather"]["analytic"]["packed_params"] > 0
    bf16, packed = (r[n]["counted"]["all_gather"]["bytes"] for n in ("nvfp4_bf16_gather", "nvfp4_nvfp4_gather"))
    assert bf16 == r["bf16"]["counted"]["all_gather"]["bytes"]      # BF16 gathers of packed storage: BF16's bytes
    assert packed < 0.5 * bf16                                      # codes + scales instead of BF16
    rs = {n: r[n]["counted"]["reduce_scatter"]["bytes"] for n in ("bf16", "nvfp4_fp32_rs")}
    assert rs["nvfp4_fp32_rs"] == 2 * rs["bf16"]

