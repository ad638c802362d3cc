"""Real 2-rank ZeRO-3 runs (gloo, CPU): packed storage, exactness, gathers, checkpoints, DeepSpeed features."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.zero.harness import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_gather() -> list[dict]:
    return run_ranks("train", steps=6)


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
    nvfp4 = run_ranks("train", steps=6, config={"precision.communication.all_gather": "nvfp4"})
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
    res = run_ranks("train", steps=4, config={"precision.weights.scaling": "4over6",
                                              "precision.communication.all_gather": gather})
    for r in res:
        for when in ("before", "after"):
            packed = {n: v for n, v in r[when].items() if v["packed"]}
            assert packed and all(v["equal"] for v in packed.values()), (when, r[when])
            assert not all(v["standard"] for v in packed.values())  # 4/6 chose map-to-4 somewhere
        assert r["finite"] and "4/6 scaling (bound 256, MAE)" in r["recipe"]
        if gather == "nvfp4":
            assert all(r["weight_quantizations"][n] == 0 for n in packed)  # the gathered 4/6 codes were reused


def test_checkpoint_resume_is_exact(tmp_path) -> None:
    res = run_ranks("checkpoint", dir=str(tmp_path / "ckpt"),
                    config={"zero_optimization.stage3_gather_16bit_weights_on_model_save": True})
    for r in res:
        assert r["resumed"] == r["rest"], (r["rest"], r["resumed"])
        assert r["d_res"] == r["d_ref"]  # every FP32 master, bit for bit (sha256 of the full tensor)
        assert all(v["equal"] for v in r["exact_after_resume"].values() if v["packed"])
    # every rank's RNG state is in place before `latest` names the checkpoint (a crash between them must leave
    # `latest` on the previous checkpoint, not on one without the state that makes resume bit-exact)
    rng = [t for r in res for t, name in r["renamed"] if name.startswith("ds_nvfp4_rng_rank")]
    (latest,) = [t for r in res for t, name in r["renamed"] if name == "latest"]
    assert len(rng) == len(res) and max(rng) < latest
    (meta,) = [t for r in res for t, name in r["renamed"] if name == "ds_nvfp4.json"]
    assert meta < latest
    # zero_to_fp32 reads the checkpoint unchanged (trainable low-precision partitions are never saved)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"), tag="step3")
    d3 = res[0]["d3"]
    assert set(sd) == set(d3)
    for k, v in sd.items():
        assert _digest(v) == d3[k], k
    # save_16bit_model writes the BF16 weights the forward sees
    model16 = torch.load(tmp_path / "ckpt" / "model16.bin", weights_only=True)
    assert model16["blocks.0.fc1.weight"].dtype == torch.bfloat16 and model16["blocks.0.fc1.weight"].shape == (256, 64)


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def test_gathered_parameters_with_modifier_rank() -> None:
    for r in run_ranks("modify"):
        assert r["kept_bytes"], "an unmodified weight must keep its packed bytes"
        assert r["changed_bytes"] and r["repacked_equal"], r


def test_offload_optimizer_gradient_accumulation_and_clipping() -> None:
    res = run_ranks("train", steps=4, config={"zero_optimization.offload_optimizer": {"device": "cpu"},
                                              "zero_force_ds_cpu_optimizer": False, "gas": 2,
                                              "gradient_clipping": 0.5})
    for r in res:
        assert r["finite"] and r["report"]["packed_params"] == 7
        assert all(v["equal"] for v in r["after"].values() if v["packed"])
        # safe_get_full_grad of the packed weights: the full [out, in] gradient, finite, not all zero
        assert r["grads"] and all(g["shape"] == r["weight_shapes"][n] and g["finite"] and g["norm"] > 0
                                  for n, g in r["grads"].items()), r["grads"]


def test_zero2_converts_but_stores_bf16() -> None:
    res = run_ranks("train", steps=3, config={"preset": "nvfp4_zero2.json"})
    for r in res:
        assert r["report"] is None and r["finite"]
        assert any(layer["fp4"] for layer in r["conversion"]["layers"])


def _to_universal(ckpt, tag: str) -> str:
    import subprocess
    import sys

    out = f"{ckpt}/{tag}_universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    f"{ckpt}/{tag}", "--output_folder", out, "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   check=True, timeout=300, capture_output=True)
    return f"{tag}_universal"


@pytest.mark.parametrize("save_ranks, load_ranks", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_ranks(tmp_path, save_ranks: int, load_ranks: int) -> None:
    ckpt = tmp_path / "ckpt"
    saved = run_ranks("save", world_size=save_ranks, dir=str(ckpt))[0]
    tag = _to_universal(ckpt, "step3")
    for r in run_ranks("load_universal", world_size=load_ranks, dir=str(ckpt), tag=tag):
        assert r["d"] == saved["d"]  # every FP32 master through the universal checkpoint, bit for bit
        assert r["finite"] and all(x["equal"] for x in r["exact"].values() if x["packed"])


def test_config_from_args_and_plain_deepspeed_when_disabled() -> None:
    for r in run_ranks("args_form"):
        nv, bf = r["nvfp4_zero3.json"], r["bf16_zero3.json"]
        # the default preset keeps the first and the last of the 3 blocks BF16: blocks.1's two Linears, odd and mix
        assert nv["has_state"] and nv["fp4_layers"] == 4 and nv["report"]
        assert not bf["has_state"] and bf["fp4_layers"] == 0 and not bf["report"]
        assert math.isfinite(nv["loss"]) and math.isfinite(bf["loss"])


def test_no_shared_memory_left_behind(bf16_gather) -> None:
    """DeepSpeed's CPU shm all-reduce leaks a 69 MB /dev/shm segment per rank and run; initialize unlinks it."""
    for r in bf16_gather:
        assert r["shm_segment"] == {"created": True, "left_behind": False}
        assert r["finite"]  # the all-reduces after the unlink still worked (the mapping outlives the name)


@pytest.mark.parametrize("override", [{"zero_optimization.offload_param": {"device": "cpu"}},
                                      {"zero_optimization.zero_hpz_partition_size": 2}],
                         ids=["offload_param", "hpz"])
def test_offload_param_and_hpz(override: dict, bf16_gather) -> None:
    res = run_ranks("train", steps=3, config=override)
    for r, ref in zip(res, bf16_gather):
        assert r["report"]["packed_params"] == 7
        assert all(v["equal"] for v in r["after"].values() if v["packed"])
        assert r["losses"] == ref["losses"][:3]  # same numbers as the plain ZeRO-3 run


def test_precision_statistics_reach_deepspeeds_monitor(tmp_path) -> None:
    """precision.monitor + csv_monitor: ds_nvfp4 writes Train/Precision/... at every interval-th step by itself."""
    run_ranks("train", steps=5, config={"precision.monitor": {"enabled": True, "interval": 2},
                                        "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                        "job_name": "job"}})
    files = {f.name: f for f in (tmp_path / "job").glob("Train_Precision_*.csv")}
    for name in ("Train_Precision_blocks.1.fc1_input_rel_error.csv", "Train_Precision_odd_weight_amax.csv",
                 "Train_Precision_blocks.2.fc2_grad_output_flushed_to_zero.csv"):
        assert name in files, sorted(files)[:5]
        rows = [ln.split(",") for ln in files[name].read_text().splitlines()[1:]]
        assert [int(r[0]) for r in rows] == [2, 4]  # steps 2 and 4 of 5, once each (rank 0 only)
        assert all(math.isfinite(float(r[1])) for r in rows)
    rel = [float(r.split(",")[1]) for r in files["Train_Precision_blocks.1.fc1_input_rel_error.csv"].read_text()
           .splitlines()[1:]]
    assert all(0.01 < v < 0.3 for v in rel), rel  # 1x16 NVFP4 of Gaussian-like activations: ~10% relative error


def test_unmodified_deepspeed_initialize_with_zero_init_model_trains_nvfp4(tmp_path) -> None:
    """The contract of the start-up hook, on 2 real ranks: plain ``deepspeed.initialize`` honours ``precision``."""
    for r in run_ranks("plain_deepspeed", dir=str(tmp_path)):
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


def test_fused_groups_share_one_amax_in_the_packed_store_and_are_unfused_with_bf16_storage() -> None:
    r0 = run_ranks("fused")[0]
    assert r0["fused_groups"] == [[f"blocks.{i}.fc1", f"blocks.{i}.fc2"] for i in range(3)]
    assert all(v["group"] for v in r0["layers"].values()), r0["layers"]
    assert not all(v["own"] for v in r0["layers"].values())  # the shared amax is not each layer's own
    r0 = run_ranks("fused", config={"precision.weights.storage": "bf16"})[0]
    assert r0["fused_groups"] == []
    assert sum("does not share an amax: ZeRO-3 with weights.storage" in n for n in r0["notes"]) == 3, r0["notes"]


@pytest.mark.parametrize("preset", ["nvfp4_zero3.json", "nvfp4_zero2.json"])
def test_nonfinite_gradients_raise_on_every_rank_with_the_step_and_the_layer(preset: str) -> None:
    ranks = run_ranks("nonfinite", preset=preset, bad_steps=[3])  # NaN on rank 1 only: rank 0 must stop too
    for r in ranks:
        assert r["raised_at"] == 3 and "step 3: gradients hold NaN/Inf" in r["error"], r
        assert r["masters_unchanged"] and r["all_masters_finite"] and len(r["losses"]) == 2
    assert "first FP4 layers with a non-finite input or output on this rank: blocks.1.fc1" in ranks[1]["error"]
    assert "no FP4 layer saw a non-finite" in ranks[0]["error"]


def test_nonfinite_skip_is_counted_and_bounded() -> None:
    cfg = {"precision.nonfinite": {"action": "skip", "max_consecutive_skips": 2}}
    for r in run_ranks("nonfinite", config=cfg, bad_steps=[2, 4, 5, 6]):
        assert r["unchanged_after_skip"] == [True, True, True] and r["all_masters_finite"]
        assert r["raised_at"] == 6 and "3 steps in a row were skipped, more than" in r["error"], r
        assert r["skipped"] == 4 and len(r["losses"]) == 2  # steps 1 and 3 trained


def test_reduce_scatter_fp32_sets_deepspeeds_communication_data_type() -> None:
    for r in run_ranks("comm_dtype"):
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
    res = run_ranks("variants", world_size=4, variants=variants, save=str(ckpt), timeout=900)
    for r in res:
        a, b, h = r["16x16"], r["1x16"], r["hpz2"]
        assert a["report"]["packed_params"] == 7 and "cuts a 16x16 tile" in a["report"]["kept_bf16"]["odd.weight"]
        assert b["report"]["packed_params"] == 8 and b["report"]["kept_bf16"] == {}
        assert h["report"]["packed_params"] == 7 and h["losses"] == a["losses"]
        assert all(_all_exact(v) for v in (a, b, h)) and all(math.isfinite(x) for x in a["losses"] + b["losses"])
        assert all(v["packed"] for v in b["after"].values())
    tag = _to_universal(ckpt, "step3")
    for r in run_ranks("load_universal", world_size=2, dir=str(ckpt), tag=tag):
        assert r["d"] == res[0]["16x16"]["d"]  # 4 -> 2 ranks, every tensor bit for bit
        assert r["finite"] and all(x["equal"] for x in r["exact"].values() if x["packed"])


def test_three_ranks_pad_partitions_which_are_stored_bf16_and_reported() -> None:
    for r in run_ranks("train", world_size=3, steps=2):
        kept = r["report"]["kept_bf16"]
        assert "do not split evenly over 3 ranks" in kept["blocks.0.fc1.weight"], kept  # 16384 % 3 != 0
        assert r["finite"] and all(v["equal"] for v in r["after"].values() if v["packed"])
        assert r["report"]["packed_params"] + r["report"]["bf16_params"] > 0


def test_weight_is_quantized_once_per_optimizer_step() -> None:
    """ZeRO-2, 2 micro-batches per step, block 1 activation-checkpointed, an evaluation forward at the end: with the
    cache every FP4 layer quantizes its weight once per weight version (3 steps + the weights the evaluation sees
    after the last step = 4), without it once per forward; the codes are the same, so the losses are equal bit for
    bit (a cache that missed an optimizer step's update would change them)."""
    on = run_ranks("weight_cache", cache="1")
    off = run_ranks("weight_cache", cache="0")
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        assert a["counts"] and set(a["counts"].values()) == {4}, a["counts"]
        for name, n in b["counts"].items():
            # 3 steps x 2 micro-batches + the evaluation forward, + block 1's recomputation in each of 6 backwards
            assert n == (13 if name.startswith("blocks.1.") else 7), (name, n)
        assert any("once per optimizer step" in note for note in a["notes"])
        assert any("every forward (DS_NVFP4_WEIGHT_CACHE=0)" in note for note in b["notes"])


@pytest.mark.parametrize("preset,gemms", [("nvfp4_zero3.json", "forward"), ("nvfp4_full_zero3.json", "backward")])
def test_precision_schedule_warmup_late_switch_and_resume(tmp_path, preset: str, gemms: str) -> None:
    """precision.schedule under packed ZeRO-3: the BF16 warm-up is plain BF16 training (losses equal a BF16 engine's
    bit for bit), storage is packed exactly from the masters only in the FP4 phase, the late switch turns the named
    GEMMs BF16 (forward: BF16 weights too), and runs resumed from checkpoints on either side of a switch repeat the
    uninterrupted run's losses exactly."""
    res = run_ranks("schedule", dir=str(tmp_path / "ckpt"), gemms=gemms,
                    config={"preset": preset, "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                              "job_name": "job"}})
    for r in res:
        assert r["phases"] == ["warmup"] * 2 + ["fp4"] * 2 + ["late"] * 3
        assert r["losses"][:2] == r["bf16"], (r["losses"][:2], r["bf16"])  # warm-up: BF16 training itself
        late_packed = gemms == "backward"
        assert [n > 0 for n in r["packed"]] == [False] * 2 + [True] * 2 + [late_packed] * 3
        assert r["exact"][2:4] == [True, True]  # FP4 phase: the packed weights are the quantized masters
        assert r["bf16_only"] == [True] * 2 + [False] * 2 + [gemms == "forward" and preset == "nvfp4_zero3.json"] * 3
        for tag, rest in r["resumed"].items():
            assert rest == r["losses"][int(tag):], (tag, rest, r["losses"])
        assert [t["phase"] for t in r["schedule"]["transitions"]] == ["warmup", "fp4", "late"]
        assert any("precision.schedule" in n for n in r["notes"])
    fwd = [ln.split(",") for ln in (tmp_path / "job" / "Train_Precision_fp4_forward.csv").read_text().splitlines()[1:]]
    assert [(int(s), float(v)) for s, v in fwd] == [(s, float(s in (3, 4) or (s >= 5 and gemms == "backward")))
                                                    for s in range(1, 8)]


@pytest.mark.parametrize("preset", ["nvfp4_zero2.json", "nvfp4_zero3.json"])
def test_every_feature_with_unmanaged_gradient_accumulation(tmp_path, preset: str) -> None:
    """``managed_gradient_accumulation: false``: DeepSpeed's boundary probe is False outside step(), so features
    that asked it never ran (the weight cache kept step 1's codes, no NaN was reported, the schedule stood still).
    The lifecycle reads DeepSpeed's step counter instead."""
    for r in run_ranks("unmanaged", preset=preset, dir=str(tmp_path)):
        assert r["losses_cache1"] == r["losses_cache0"], (r["losses_cache1"], r["losses_cache0"])
        if preset == "nvfp4_zero2.json":  # ZeRO-0/1/2: once per optimizer step; without the cache once per forward
            # (block 1 is activation-checkpointed: 4 steps x 2 micro-batches x (forward + recomputation))
            assert r["quantizations_cache1"] == 4 and r["quantizations_cache0"] == 16
        assert r["phases"] == ["warmup", "fp4", "fp4", "late"] and r["global_steps"] == 4
        assert r["order"] == ["weight_cache", "nonfinite", "statistics", "schedule", "checkpoint"]
        assert r["error"] is not None and r["raised_at"] == 3 and "step 3" in r["error"], r.get("error")
    rows = (tmp_path / "job" / "Train_Precision_blocks.1.fc1_input_rel_error.csv").read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in rows] == [2, 3]  # every step with an FP4 forward (interval 1)


def test_pipeline_engine_gets_fp4_layers_and_every_feature(tmp_path) -> None:
    res = run_ranks("pipeline", dir=str(tmp_path / "ckpt"))
    for r in res:
        assert r["type"].startswith("NVFP4PipelineEngine")
        # the pipeline's DeepSpeed names (train_batch, layer specs, stage grid) were checked at start-up
        assert r["seam_scopes"] == ["engine", "pipeline"] and r["stats_when_monitor_off"], r["seam_scopes"]
        assert r["losses_cache1"] == r["losses_cache0"] and all(math.isfinite(v) for v in r["losses_cache1"])
        assert r["phases"] == ["warmup", "fp4", "fp4", "fp4"]
        assert r["resumed_losses"] == r["schedule_losses"][2:], (r["resumed_losses"], r["schedule_losses"])
        # the spike guard saw train_batch's loss of each step (identical on both stages), and no spike
        assert r["guard"]["history"] == r["schedule_losses"] and r["guard"]["episodes"] == [], r["guard"]
        assert r["error"] is not None and r["raised_at"] == 3, r.get("error")
        notes = " ".join(r["conversion"]["notes"])
        assert f"pipeline stage {r['rank']} of 2" in notes
    # 4 blocks over 2 stages; the first and the last block stay BF16 (keep_first/last_blocks_bf16: 1)
    by_rank = {r["rank"]: r for r in res}
    assert by_rank[0]["fp4_layers"] == ["2.fc1", "2.fc2"] and by_rank[1]["fp4_layers"] == ["3.fc1", "3.fc2"]
    reasons = {d["name"]: d["reason"] for r in res for d in r["conversion"]["layers"]}
    assert "in block 0 of 4" in reasons["1.fc1"] and "in block 3 of 4" in reasons["4.fc1"]



@pytest.mark.parametrize("families", [["qwen2_moe", "qwen3_moe", "mixtral"], ["olmoe", "deepseek_v3", "gpt2"],
                                      ["gpt_oss", "dbrx", "llama4_text"]],
                         ids=["qwen2moe-qwen3moe-mixtral", "olmoe-deepseekv3-gpt2", "gptoss-dbrx-llama4"])
def test_moe_experts_and_conv1d_train_nvfp4_under_plain_deepspeed(families: list[str]) -> None:
    """Every expert matrix and every GPT-2 Conv1D in NVFP4 (packed ZeRO-3, exact per expert), routers BF16 with
    their reason, through an unmodified deepspeed.initialize call."""
    for r in run_ranks("families", families=families, timeout=900):
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


def test_experts_become_zero3_leaf_modules_so_ranks_routing_differently_do_not_hang() -> None:
    """ds_nvfp4.initialize makes every experts module a ZeRO-3 leaf: ranks that run different experts (few tokens,
    per-rank data) train and evaluate to the end instead of waiting on each other (zero/leaves.py)."""
    res = run_ranks("reference_moe", timeout=240)
    # the case that hangs without leaf modules: some forward where the two ranks ran different sets of experts
    assert any(a != b for a, b in zip(res[0]["hit"], res[1]["hit"])), [r["hit"] for r in res]
    for r in res:
        assert r["finite"] and len(r["losses"]) == 3
        assert any("4 experts modules made leaf modules" in n for n in r["notes"]), r["notes"]
        assert r["fp4_experts"] == ["blocks.1.moe.experts.gate_up_proj", "blocks.1.moe.experts.down_proj",
                                    "blocks.2.moe.experts.gate_up_proj", "blocks.2.moe.experts.down_proj"]


#: learning-rate factors per step: warm-up (steps 1-2), constant (3-5), decay from step 6
WSD = [0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.25]


def test_late_switch_at_the_start_of_learning_rate_decay_found_from_the_run_and_resumed(tmp_path) -> None:
    """``bf16_from: "lr_decay"`` under a warmup-stable-decay LambdaLR: FP4 until step 5, the late phase from step 6
    (where the learning rate first falls after its constant stretch); checkpoints before and after the switch
    resume to the same phases and losses (what was found is saved in ds_nvfp4.json)."""
    res = run_ranks("lr_decay", factors=WSD, resume=True, dir=str(tmp_path / "ckpt"))
    for r in res:
        assert r["phases"] == ["fp4"] * 5 + ["late"] * 2, r["phases"]
        assert r["schedule"]["first_late_step"] == 6 and r["schedule"]["lr_decay"]["found"] == 6
        assert r["warnings"] == []
        for tag, got in r["resumed"].items():
            assert got["phases"] == r["phases"][int(tag):], (tag, got)
            assert got["losses"] == r["losses"][int(tag):], (tag, got)
    meta = json.loads((tmp_path / "ckpt" / "step4" / "ds_nvfp4.json").read_text())
    assert meta["schedule"]["lr_decay"]["found"] is None and meta["schedule"]["lr_decay"]["stable_steps"] == 3


def test_lr_decay_switch_with_a_schedule_that_has_no_constant_stretch_says_there_is_no_switch() -> None:
    res = run_ranks("lr_decay", factors=[0.5, 1.0, 0.9, 0.7, 0.5, 0.3, 0.1])
    by_rank = {r["rank"]: r for r in res}
    for r in res:
        assert r["phases"] == ["fp4"] * 7 and r["schedule"]["first_late_step"] is None
        assert r["schedule"]["lr_decay"]["no_plateau_at"] == 3
    assert any("NO late BF16 switch" in w and "from step 3" in w for w in by_rank[0]["warnings"]), by_rank[0]


@pytest.mark.parametrize("preset", [None, pytest.param("nvfp4_zero2.json", marks=pytest.mark.slow),
                                    pytest.param("nvfp4_zero3_offload.json", marks=pytest.mark.slow)],
                         ids=["zero3", "zero2", "zero3_offload"])
def test_spike_guard_runs_bf16_after_a_pooled_loss_spike_on_every_rank_and_resumes(tmp_path, preset) -> None:
    """``schedule.spike_guard``: a spike on one rank only (rank 1's loss x8 at step 6) opens the same BF16 episode
    on both ranks (the loss is pooled), steps 7-8 run BF16 with BF16 weights and step 9 FP4 on packed weights
    again; the second spike (step 9) finds the one episode spent and is reported; a run resumed inside the episode
    repeats it; the monitor records the episode. The same under the other presets that ship the guard: ZeRO-2
    (BF16 storage: nothing is packed, the FP4 GEMMs quantize on the fly) and the offloaded optimizer."""
    config = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    res = run_ranks("spike_guard", spikes=[6, 9], dir=str(tmp_path / "ckpt"),
                    config=config if preset is None else {**config, "preset": preset})
    for r in res:
        assert r["phases"] == ["fp4"] * 6 + ["guard"] * 2 + ["fp4"], r["phases"]  # steps 1..9
        packed = [False] * 9 if preset == "nvfp4_zero2.json" else [True] * 6 + [False] * 2 + [True]
        assert [n > 0 for n in r["packed"]] == packed
        assert r["bf16_only"] == [False] * 6 + [True] * 2 + [False]
        eps = r["schedule"]["spike_guard"]["episodes"]
        assert [(e["detected_at"], e["start"], e["end"]) for e in eps] == [(6, 7, 8)], eps
        assert r["schedule"]["spike_guard"]["ignored"] == [9]
        assert [t["phase"] for t in r["schedule"]["transitions"]] == ["fp4", "guard", "fp4"]
        assert r["share"] == pytest.approx(r["share_planned"] * 7 / 9)  # 2 of 9 steps ran BF16
        assert r["resumed"] == {"phases": r["phases"][7:], "losses": r["losses"][7:]}, r["resumed"]
        assert any("spike guard" in n for n in r["notes"]), r["notes"]
    by_rank = {r["rank"]: r for r in res}
    assert any("step 9" in w and "episodes (max_episodes) are spent" in w for w in by_rank[0]["warnings"]), \
        by_rank[0]["warnings"]
    rows = (tmp_path / "job" / "Train_Precision_spike_guard_episodes.csv").read_text().splitlines()[1:]
    assert [tuple(map(float, row.split(","))) for row in rows] == [(6.0, 1.0)]
    fwd = [ln.split(",") for ln in (tmp_path / "job" / "Train_Precision_fp4_forward.csv").read_text().splitlines()[1:]]
    assert [float(v) for _, v in fwd] == [1.0] * 6 + [0.0] * 2 + [1.0]


def test_the_bytes_each_collective_moves_are_the_analytic_bytes():
    """What ``ds-nvfp4 explain`` / the start-up line / docs/scaling.md say a step moves is what it moves: the
    collectives of one real 2-rank step, counted by wrapping torch.distributed, against ds_nvfp4.zero.traffic (one
    gather pass: DeepSpeed keeps this small model gathered from the forward to the backward)."""
    r = run_ranks("traffic", count_collectives=True)[0]
    for name, got in r.items():
        if name in ("rank", "shm_segment", "finite"):
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
