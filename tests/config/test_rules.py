"""Every rule of the precision section: valid and invalid configs, messages that name the key."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ds_nvfp4
from ds_nvfp4.config import ConfigError, PrecisionConfig, check_config, load_config
from ds_nvfp4.format import WeightScaling

PRESETS = Path(__file__).resolve().parents[2] / "ds_configs"
BASE = json.loads((PRESETS / "nvfp4_zero3.json").read_text())


def cfg(**precision) -> dict:
    d = copy.deepcopy(BASE)
    d["precision"] = {"enabled": True, **precision}
    return d


def errors(d: dict) -> list:
    return [p for p in check_config(d)[1] if p.severity == "error"]


def test_defaults_are_the_contract() -> None:
    assert PrecisionConfig().model_dump() == {
        "enabled": False, "format": "nvfp4",
        "weights": {"storage": None, "block": "16x16", "scaling": "6", "e4m3_bound": None, "scaling_error": "MAE"},
        "activations": {"block": "1x16", "hadamard": False},
        "backward": {"gemm": "bf16", "stochastic_rounding": True, "hadamard": True},
        "communication": {"all_gather": "bf16", "reduce_scatter": "bf16"},
        "modules": {"include": ["*"], "exclude": ["lm_head", "*embed*"],
                    "keep_first_blocks_bf16": 0, "keep_last_blocks_bf16": 0, "keep_last_fraction_bf16": 0.0,
                    "overrides": [],
                    "fuse": [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]},
        "kernel": None, "monitor": {"enabled": False, "interval": 100},
        "nonfinite": {"action": "raise", "max_consecutive_skips": 8},
        "schedule": {"bf16_warmup_steps": 0, "bf16_from": None, "bf16_gemms": "forward", "total_steps": None,
                     "spike_guard": None},
        "base": {"frozen": False, "checkpoint": None},
    }


def test_a_frozen_checkpoint_base_needs_packed_1x16_nvfp4_gathers() -> None:
    """The forward multiplies the checkpoint's codes as stored: one error naming everything that must change."""
    frozen = {"base": {"frozen": True, "checkpoint": "some/folder"}}
    got = errors(cfg(**frozen))  # the preset: ZeRO-3, 16x16, BF16 gathers
    assert [p.path for p in got] == ["precision.base.checkpoint"]
    assert 'weights.block: "1x16"' in got[0].message and 'all_gather: "nvfp4"' in got[0].message
    assert "zero_optimization.stage" not in got[0].message
    d = cfg(weights={"block": "1x16"}, communication={"all_gather": "nvfp4"}, **frozen)
    assert errors(d) == []
    # 4/6 decodes block scales with the bound 256: the checkpoint's (made with 448) would be read 1.75x off
    four_six = cfg(weights={"block": "1x16", "scaling": "4over6"}, communication={"all_gather": "nvfp4"}, **frozen)
    assert [p.path for p in errors(four_six)] == ["precision.base.checkpoint"]
    assert 'scaling "4over6", bound 256' in errors(four_six)[0].message
    assert errors(cfg(weights={"block": "1x16", "scaling": "4over6", "e4m3_bound": 448},
                      communication={"all_gather": "nvfp4"}, **frozen)) == []
    d["zero_optimization"]["stage"] = 2
    paths = [p.path for p in errors(d)]
    assert "precision.base.checkpoint" in paths and any("stage: 3" in p.message for p in errors(d))
    # continued training (not frozen) and a frozen base without a checkpoint have no such needs
    assert errors(cfg(base={"checkpoint": "some/folder"})) == errors(cfg(base={"frozen": True})) == []


@pytest.mark.parametrize(
    "schedule, extra, path, needle",
    [
        ({"bf16_from": 1.5, "total_steps": 100}, {}, "precision.schedule.bf16_from", "strictly between 0 and 1"),
        ({"bf16_from": 0}, {}, "precision.schedule.bf16_from", "counted from 1"),
        ({"bf16_from": 0.9}, {}, "precision.schedule.total_steps", "run's length is unknown"),
        ({"bf16_from": 5, "bf16_warmup_steps": 4}, {}, "precision.schedule.bf16_from", "no step would run in FP4"),
        ({"bf16_from": 0.9, "bf16_gemms": "backward", "total_steps": 100}, {}, "precision.schedule.bf16_gemms",
         "switches nothing"),
        ({"bf16_from": True}, {}, "precision.schedule.bf16_from",
         'expected an integer or a number or "lr_decay" or null, got true'),
        ({"bf16_from": "decay"}, {}, "precision.schedule.bf16_from",
         'expected an integer or a number or "lr_decay" or null, got "decay"'),
        ({"bf16_gemms": "wgrad"}, {}, "precision.schedule.bf16_gemms", '"wgrad"'),
        ({"spike_guard": {"loss_ratio": 1.0}}, {}, "precision.schedule.spike_guard.loss_ratio", "must be > 1.0"),
        ({"spike_guard": {"windw": 5}}, {}, "precision.schedule.spike_guard.windw", "did you mean 'window'"),
        ({"spike_guard": True}, {}, "precision.schedule.spike_guard", "a JSON object or null"),
    ],
)
def test_schedule_rules(schedule: dict, extra: dict, path: str, needle: str) -> None:
    probs = errors(cfg(schedule=schedule, **extra))
    assert [p.path for p in probs] == [path] and needle in probs[0].message, probs


def test_schedule_fraction_resolves_against_total_steps_or_deepspeeds_scheduler() -> None:
    from ds_nvfp4.config.schedule import first_late_bf16_step

    d = cfg(schedule={"bf16_from": 0.85, "total_steps": 2100})
    assert errors(d) == [] and first_late_bf16_step(d, load_config(d)[1]) == 1786  # the last 315 steps (15%)
    d = cfg(schedule={"bf16_from": 0.29})
    d["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}
    assert errors(d) == [] and first_late_bf16_step(d, load_config(d)[1]) == 30  # 0.29 * 100 is 28.999...: 29 steps
    d = cfg(schedule={"bf16_from": 7, "bf16_warmup_steps": 3, "bf16_gemms": "backward"}, backward={"gemm": "nvfp4"})
    assert errors(d) == [] and first_late_bf16_step(d, load_config(d)[1]) == 7


def test_schedule_phases_and_fp4_share() -> None:
    from ds_nvfp4.config.schedule import SchedulePlan

    pc = load_config(cfg(schedule={"bf16_warmup_steps": 2, "bf16_from": 9}, backward={"gemm": "nvfp4"}))[1]
    plan = SchedulePlan.from_config(pc, {})
    got = [(plan.phase(s).name, plan.phase(s).forward_fp4, plan.phase(s).backward_fp4, plan.phase(s).packed)
           for s in (1, 2, 3, 8, 9, 10)]
    assert got == [("warmup", False, False, False)] * 2 + [("fp4", True, True, True)] * 2 + [
        ("late", False, True, False)] * 2
    # 10 steps: 2 warm-up (no FP4), 6 FP4 steps (3 GEMMs), 2 late steps (Dgrad+Wgrad): (18 + 4) / 30 of the FP4
    # layers' FLOPs, which are 3/4 of all Linear FLOPs
    assert plan.fp4_share(10, 3, 4) == pytest.approx(22 / 30 * 3 / 4)


def test_absent_section_means_disabled() -> None:
    d = copy.deepcopy(BASE)
    d.pop("precision")
    _, pc = load_config(d)
    assert pc.enabled is False


@pytest.mark.parametrize(
    "precision, path, needle, allowed",
    [
        ({"format": "mxfp4"}, "precision.format", '"mxfp4"', '"nvfp4"'),
        ({"weights": {"storage": "fp8"}}, "precision.weights.storage", '"fp8"', '"nvfp4", "bf16", null'),
        ({"weights": {"block": "32"}}, "precision.weights.block", '"32"', '"16x16", "1x16"'),
        ({"activations": {"block": "16x16"}}, "precision.activations.block", '"16x16"', '"1x16"'),
        ({"backward": {"gemm": "fp8"}}, "precision.backward.gemm", '"fp8"', '"bf16", "nvfp4"'),
        ({"communication": {"all_gather": "fp8"}}, "precision.communication.all_gather", '"fp8"', '"bf16", "nvfp4"'),
        ({"communication": {"reduce_scatter": "fp16"}}, "precision.communication.reduce_scatter", '"fp16"',
         '"bf16", "fp32"'),
        ({"kernel": "cutlass"}, "precision.kernel", '"cutlass"', '"torch", "transformer_engine", "emulated", null'),
        ({"enabled": "yes"}, "precision.enabled", "boolean", "true, false"),
        ({"modules": {"keep_first_blocks_bf16": -1}}, "precision.modules.keep_first_blocks_bf16", ">= 0", ""),
        ({"modules": {"keep_last_blocks_bf16": 1.5}}, "precision.modules.keep_last_blocks_bf16", "integer", ""),
        ({"modules": {"include": "blocks.*"}}, "precision.modules.include", "list", ""),
        ({"monitor": {"interval": 0}}, "precision.monitor.interval", ">= 1", ""),
        ({"weights": "nvfp4"}, "precision.weights", "object", ""),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(precision, path, needle, allowed) -> None:
    probs = errors(cfg(**precision))
    assert len(probs) == 1, probs
    p = probs[0]
    assert p.path == path and needle in p.message
    assert ", ".join(p.allowed) == allowed


@pytest.mark.parametrize(
    "precision, path, suggestion",
    [
        ({"weights": {"storge": "nvfp4"}}, "precision.weights.storge", "storage"),
        ({"backwards": {}}, "precision.backwards", "backward"),
        ({"modules": {"keep_first_block_bf16": 1}}, "precision.modules.keep_first_block_bf16",
         "keep_first_blocks_bf16"),
        ({"kernal": None}, "precision.kernal", "kernel"),
    ],
)
def test_unknown_keys_get_did_you_mean(precision, path, suggestion) -> None:
    (p,) = errors(cfg(**precision))
    assert p.path == path and f"did you mean {suggestion!r}" in p.message


@pytest.mark.parametrize("where", [("kernel",), ("weights", "block"), ("monitor", "interval"), ("enabled",)])
def test_auto_is_rejected_with_advice(where) -> None:
    precision: dict = {}
    node = precision
    for k in where[:-1]:
        node = node.setdefault(k, {})
    node[where[-1]] = "auto"
    probs = errors(cfg(**precision)) if where != ("enabled",) else errors({**BASE, "precision": {"enabled": "auto"}})
    (p,) = probs
    assert p.path == "precision." + ".".join(where)
    assert '"auto" is not allowed' in p.message and "Accelerate" in p.message and "write" in p.message


def test_fp16_and_missing_bf16_are_rejected() -> None:
    d = cfg()
    d["fp16"] = {"enabled": True}
    d["bf16"] = {"enabled": False}
    msgs = [p.message for p in errors(d)]
    assert any("fp16.enabled: true" in m for m in msgs)
    assert any("bf16.enabled: true" in m for m in msgs)


def test_disabled_section_skips_cross_checks() -> None:
    d = cfg()
    d["precision"]["enabled"] = False
    d["zero_optimization"]["stage"] = 2
    assert errors(d) == []


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_nvfp4_storage_needs_stage_3(stage: int) -> None:
    """Storage follows the stage by default (packed under ZeRO-3, BF16 below: the README's one-line section works
    with any stage); an explicit "nvfp4" below stage 3 is an error."""
    d = cfg()
    d["zero_optimization"]["stage"] = stage
    assert errors(d) == []
    pc = load_config(d)[1]
    assert not pc.stored_packed(stage) and pc.stored_packed(3)
    assert f"ZeRO-{stage}: storage follows the stage" in pc.describe_storage(stage)
    d["precision"]["weights"] = {"storage": "nvfp4"}
    (p,) = errors(d)
    assert p.path == "precision.weights.storage"
    assert "zero_optimization.stage: 3" in p.message and f"found stage {stage}" in p.message and '"bf16"' in p.message
    d["precision"]["weights"] = {"storage": "bf16"}
    assert errors(d) == []


def test_nvfp4_all_gather_needs_nvfp4_storage_and_stage_3() -> None:
    (p,) = errors(cfg(weights={"storage": "bf16"}, communication={"all_gather": "nvfp4"}))
    assert p.path == "precision.communication.all_gather" and "precision.weights.storage" in p.message
    assert errors(cfg(communication={"all_gather": "nvfp4"})) == []


def test_fp4_backward_needs_16x16_weights() -> None:
    (p,) = errors(cfg(weights={"block": "1x16"}, backward={"gemm": "nvfp4"}))
    assert p.path == "precision.backward.gemm" and 'precision.weights.block: "16x16"' in p.message
    assert errors(cfg(backward={"gemm": "nvfp4"})) == []


def test_4over6_weights_and_their_bound() -> None:
    """weights.scaling "4over6" takes TE's bound 256 unless told 448; a bound other than 448 needs 4over6; the
    recipe and the checkpoint's export read the same quantize arguments."""
    from ds_nvfp4.nn import Recipe

    pc = load_config(cfg(weights={"scaling": "4over6"}))[1]
    assert pc.weights.quantization() == WeightScaling("4over6", 256, "MAE")
    r = Recipe.from_config(pc, "emulated")
    assert r.weight == WeightScaling("4over6", 256, "MAE")
    assert Recipe.decode(r.encode()) == r
    assert "4/6 scaling (bound 256, MAE)" in pc.describe_recipe()
    pc = load_config(cfg(weights={"scaling": "4over6", "e4m3_bound": 448, "scaling_error": "MSE"}))[1]
    assert pc.weights.quantization() == WeightScaling("4over6", 448, "MSE")
    assert load_config(cfg())[1].weights.quantization() == WeightScaling("6", 448, "MAE")
    (p,) = errors(cfg(weights={"e4m3_bound": 256}))
    assert p.path == "precision.weights.e4m3_bound" and 'scaling: "4over6"' in p.message
    assert p.allowed == ("448", "null")
    (p,) = errors(cfg(weights={"scaling": "4over6", "e4m3_bound": 300}))
    assert p.path == "precision.weights.e4m3_bound" and "256, 448" in ", ".join(p.allowed)
    (p,) = errors(cfg(weights={"scaling": "4/6"}))
    assert p.path == "precision.weights.scaling" and ", ".join(p.allowed) == '"6", "4over6"'


def test_reduce_scatter_must_agree_with_communication_data_type() -> None:
    d = cfg(communication={"reduce_scatter": "fp32"})
    d["communication_data_type"] = "bf16"
    (p,) = errors(d)
    assert p.path == "precision.communication.reduce_scatter" and "communication_data_type" in p.message


@pytest.mark.parametrize("key, suggestion", [("zero_optimisation", "zero_optimization"), ("precison", "precision"),
                                             ("gradient_cliping", "gradient_clipping")])
def test_near_miss_top_level_keys_warn(key: str, suggestion: str) -> None:
    d = cfg()
    d[key] = {}
    probs = check_config(d)[1]
    (w,) = [p for p in probs if p.severity == "warning"]
    assert w.path == key and suggestion in w.message


def test_load_config_raises_one_error_with_every_problem(tmp_path: Path) -> None:
    d = cfg(weights={"storage": "fp8", "block": "2x2"}, kernel="auto", modules={"keep_last_blocks_bf16": -1})
    d["fp16"] = {"enabled": True}
    with pytest.raises(ConfigError) as info:
        load_config(d)
    paths = [p.path for p in info.value.problems]
    # schema errors ("auto" among them) and the cross-checks that do not involve an invalid value, all at once
    assert sorted(paths) == sorted(["precision.kernel", "precision.weights.storage", "precision.weights.block",
                                    "precision.modules.keep_last_blocks_bf16", "precision.enabled"])
    assert "precision.weights.storage" in str(info.value) and "fp16.enabled" in str(info.value)


def test_cross_checks_of_invalid_values_are_not_reported() -> None:
    d = cfg(weights={"storage": "fp8"}, communication={"all_gather": "nvfp4"})
    d["zero_optimization"]["stage"] = 2
    # storage is invalid: no rule may judge the default ("nvfp4") that replaced it; all_gather still needs stage 3
    # but its message names precision.weights.storage, so it is held back until storage is fixed
    assert [p.path for p in errors(d)] == ["precision.weights.storage"]
    d["precision"]["weights"]["storage"] = "bf16"
    assert [p.path for p in errors(d)] == ["precision.communication.all_gather"]


def test_public_api() -> None:
    assert ds_nvfp4.PrecisionConfig is PrecisionConfig and ds_nvfp4.ConfigError is ConfigError
    ds, pc = ds_nvfp4.load_config(str(PRESETS / "nvfp4_full_zero3.json"))
    assert pc.backward.gemm == "nvfp4" and ds["zero_optimization"]["stage"] == 3


def _values_from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    if "$ref" in schema:
        return _values_from_schema(defs[schema["$ref"].split("/")[-1]], defs)
    if "anyOf" in schema:
        return st.one_of([_values_from_schema(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: _values_from_schema(v, defs) for k, v in props.items() if k in required},
                                     optional={k: _values_from_schema(v, defs) for k, v in props.items()
                                               if k not in required})
    if t == "string":
        return st.text(alphabet="abc.*_", min_size=1, max_size=6)
    if t == "boolean":
        return st.booleans()
    if t == "integer":
        return st.integers(min_value=schema.get("minimum", 0), max_value=1000)
    if t == "array":
        items = schema.get("items", {"type": "string"})
        inner = (_values_from_schema(items, defs) if items.get("type") != "string"
                 else st.text(alphabet="abc.*_", min_size=1, max_size=6))
        return st.lists(inner, max_size=3)
    if t == "number":
        return st.floats(min_value=schema.get("exclusiveMinimum", schema.get("minimum", -1e6)),
                         max_value=schema.get("exclusiveMaximum", schema.get("maximum", 1e6)),
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
                         allow_nan=False)
    if t == "null":
        return st.none()
    raise AssertionError(f"schema type not covered by the test: {schema}")


SCHEMA = PrecisionConfig.model_json_schema()


@given(_values_from_schema(SCHEMA, SCHEMA.get("$defs", {})))
def test_anything_the_schema_allows_validates(section: dict) -> None:
    """Property: a section built from the JSON Schema (``ds-nvfp4 schema``) passes the section validation."""
    d = copy.deepcopy(BASE)
    d["precision"] = section
    pc, probs = check_config(d)
    section_errors = [p for p in probs if p.severity == "error" and not _is_cross_check(p)]
    assert pc is not None and section_errors == []


def _is_cross_check(p) -> bool:
    return any(s in p.message for s in ("needs", "disagrees", "cannot be combined",
                                        # precision.schedule: between its keys and DeepSpeed's scheduler
                                        "run's length is unknown", "switches nothing", "no step would run in FP4"))


HF_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "precision": {"enabled": True},
}


def test_trainer_auto_values_are_accepted_with_a_note_and_a_bf16_warning() -> None:
    pc, probs = check_config(copy.deepcopy(HF_CONFIG), deepspeed_checks=True)
    assert pc is not None and [p for p in probs if p.severity == "error"] == []
    notes = [p for p in probs if p.severity == "note"]
    assert len(notes) == 1 and "optimizer.params.lr" in notes[0].path and "HF Trainer" in notes[0].message
    warn = [p for p in probs if p.severity == "warning"]
    assert [p.path for p in warn] == ["bf16.enabled"] and "resolve to true" in warn[0].message


def test_auto_outside_what_trainers_fill_and_inside_precision_stay_errors() -> None:
    d = copy.deepcopy(HF_CONFIG)
    d["zero_optimization"]["stage"] = "auto"
    d["precision"]["kernel"] = "auto"
    paths = {p.path for p in errors(d)}
    assert {"zero_optimization.stage", "precision.kernel"} <= paths
    # once resolved, bf16 false is the usual error (what initialize sees after HF filled "auto")
    d = copy.deepcopy(HF_CONFIG)
    d["bf16"]["enabled"] = False
    assert any("needs bf16.enabled: true" in p.message for p in errors(d))


def test_validate_cli_accepts_a_trainer_config(tmp_path) -> None:
    import subprocess
    import sys

    f = tmp_path / "ds.json"
    f.write_text(json.dumps(HF_CONFIG))
    r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "validate", str(f)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "note:" in r.stdout and "warning: bf16.enabled" in r.stdout and r.stdout.strip().endswith(": ok")
