"""`ds-nvfp4 validate / schema / explain`: output format and exit codes, through the real console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PRESETS = sorted((Path(__file__).resolve().parents[2] / "ds_configs").glob("*.json"))


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("ds-nvfp4") or ""
    cmd = [exe] if exe else [sys.executable, "-m", "ds_nvfp4"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def write(tmp: Path, name: str, text: str) -> str:
    p = tmp / name
    p.write_text(text)
    return str(p)


def test_presets_are_valid_including_deepspeed_checks() -> None:
    r = cli("validate", *map(str, PRESETS))
    assert r.returncode == 0, r.stderr + r.stdout
    assert r.stdout.count(": ok") == len(PRESETS) == 8


def test_bench_configs_are_valid() -> None:
    bench = sorted((PRESETS[0].parents[1] / "bench" / "configs").glob("*.json"))
    r = cli("validate", *map(str, bench))
    assert r.returncode == 0, r.stderr + r.stdout
    assert r.stdout.count(": ok") == len(bench) >= 7


def test_offload_baseline_differs_from_the_offload_preset_in_precision_alone() -> None:
    """`bench/evidence.sh`'s `bf16_offload` is the offload preset's BF16 twin (same DeepSpeed CPU Adam): a change to
    the preset outside `precision` must reach the baseline too, or the pair measures more than precision."""
    preset = json.loads((PRESETS[0].parent / "nvfp4_zero3_offload.json").read_text())
    baseline = json.loads((PRESETS[0].parents[1] / "bench" / "configs" / "bf16_zero3_offload.json").read_text())
    preset.pop("precision")
    assert baseline == preset


def test_quiet_prints_nothing_on_success() -> None:
    r = cli("validate", "-q", "--no-deepspeed", str(PRESETS[0]))
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""


def test_invalid_file_lines_name_file_path_and_allowed(tmp_path: Path) -> None:
    bad = json.loads(PRESETS[0].read_text())
    bad["precision"] = {"enabled": True, "weights": {"storage": "fp8"}, "kernal": None}
    f = write(tmp_path, "bad.json", json.dumps(bad))
    good = str(PRESETS[0])
    r = cli("validate", "--no-deepspeed", f, good)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert f'{f}: precision.weights.storage: "fp8" is not a valid value (allowed: "nvfp4", "bf16", null)' in lines
    assert any(ln.startswith(f"{f}: precision.kernal: unknown key 'kernal'; did you mean 'kernel'?") for ln in lines)
    assert f"{good}: ok" in r.stdout


def test_json_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    f = write(tmp_path, "syntax.json", '{\n  "bf16": {"enabled": true},\n  "precision": {"enabled": true,}\n}\n')
    r = cli("validate", "--no-deepspeed", f)
    assert r.returncode == 1
    assert f"{f}: (json): syntax error at line 3 column" in r.stderr


def test_duplicate_keys_are_errors(tmp_path: Path) -> None:
    f = write(tmp_path, "dup.json", '{"bf16": {"enabled": true}, "bf16": {"enabled": false}}')
    r = cli("validate", "--no-deepspeed", f)
    assert r.returncode == 1 and "duplicate key 'bf16'" in r.stderr


def test_unreadable_file_is_exit_2(tmp_path: Path) -> None:
    r = cli("validate", str(tmp_path / "missing.json"), str(PRESETS[0]))
    assert r.returncode == 2 and "missing.json: cannot read" in r.stderr


def test_usage_error_is_exit_2() -> None:
    assert cli("validate").returncode == 2
    assert cli("no-such-command").returncode == 2


def test_json_output_and_near_misses_fail_unless_allowed(tmp_path: Path) -> None:
    d = json.loads(PRESETS[0].read_text())
    d["zero_optimisation"] = {"stage": 3}
    f = write(tmp_path, "warn.json", json.dumps(d))
    r = cli("validate", "--json", "--no-deepspeed", f)
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["valid"] is False and out["exit_code"] == 1
    (problem,) = out["files"][0]["problems"]
    assert problem["severity"] == "error" and problem["path"] == "zero_optimisation"
    assert problem["code"] == "near-miss" and "--allow-unknown" in problem["message"]
    r = cli("validate", "--json", "--no-deepspeed", "--allow-unknown", f)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["valid"] is True and out["files"][0]["problems"][0]["severity"] == "warning"


@pytest.mark.parametrize("key", ["precison", "Precision", "precision_config"])
def test_a_misspelt_precision_section_fails_validate(tmp_path: Path, key: str) -> None:
    """Without a ``precision`` key DeepSpeed trains BF16 and ignores the typo: validate must not say ok."""
    d = json.loads((PRESETS[0].parent / "nvfp4_zero3.json").read_text())
    d[key] = d.pop("precision")
    f = write(tmp_path, "typo.json", json.dumps(d))
    r = cli("validate", "--no-deepspeed", f)
    assert r.returncode == 1 and f"{f}: {key}: " in r.stderr and "WITHOUT NVFP4" in r.stderr, r.stderr
    assert cli("validate", "--no-deepspeed", "--allow-unknown", f).returncode == 0


def test_deepspeed_own_checks_catch_deepspeed_errors(tmp_path: Path) -> None:
    d = json.loads((PRESETS[0].parent / "nvfp4_zero3.json").read_text())
    d["zero_optimization"]["stage"] = "three"
    d["precision"].pop("communication")  # all_gather "nvfp4" would (rightly) need a numeric stage 3
    f = write(tmp_path, "ds.json", json.dumps(d))
    r = cli("validate", f)
    assert r.returncode == 1 and f"{f}: zero_optimization.stage:" in r.stderr and "DeepSpeed's own check" in r.stderr
    # without DeepSpeed's models the stage is not ours to check (storage follows whatever stage it is)
    assert cli("validate", "--no-deepspeed", f).returncode == 0


def test_schema_is_json_schema() -> None:
    r = cli("schema")
    s = json.loads(r.stdout)
    assert r.returncode == 0 and s["type"] == "object" and "weights" in s["properties"]


@pytest.mark.parametrize("preset, needle", [("nvfp4_zero3.json", "Dgrad and Wgrad in BF16"),
                                            ("nvfp4_zero3.json", "steps 1 on: fp4: FP4 Fprop; spike guard: after a "
                                                                 "step whose loss exceeds 1.5x the median"),
                                            ("nvfp4_zero2.json", "spike guard: after a step"),
                                            ("nvfp4_zero3_offload.json", "spike guard: after a step"),
                                            ("nvfp4_full_zero3.json", "Fprop, Dgrad and Wgrad"),
                                            ("nvfp4_full_zero3.json", "steps 1-50: every converted layer in BF16 "
                                                                      "(BF16 weights); steps 51 on: fp4"),
                                            ("nvfp4_zero2.json", "stored by DeepSpeed in BF16"),
                                            ("nvfp4_zero3_lora.json", "frozen: packed once, never re-quantized"),
                                            ("nvfp4_zero3_moe.json", "the last max(2, 15% (rounded up)) transformer "
                                                                     "blocks"),
                                            ("bf16_zero3.json", "NVFP4 is disabled"),
                                            ("nvfp4_zero3_all_blocks_ablation.json", "Every transformer block is FP4"),
                                            ("../bench/configs/nvfp4_zero3_all_blocks_late_bf16_2100.json",
                                             "steps 1-1785: fp4: FP4 Fprop; steps 1786 on: late: every converted "
                                             "layer in BF16 (BF16 weights)")])
def test_explain(preset: str, needle: str) -> None:
    r = cli("explain", str(PRESETS[0].parent / preset))
    assert r.returncode == 0 and needle in r.stdout, r.stdout
    if preset == "nvfp4_zero3.json":
        assert "Every transformer block" not in r.stdout


def test_explain_invalid_is_exit_1(tmp_path: Path) -> None:
    f = write(tmp_path, "x.json", '{"precision": {"enabled": true}}')
    r = cli("explain", f)
    assert r.returncode == 1 and "bf16.enabled: true" in r.stderr


def test_explain_and_env_state_the_bytes_per_step_of_the_model(tmp_path: Path) -> None:
    """The 20M reference model (19,487,104 params; blocks 1-5 of 8 packed by the default preset: 12,042,240):
    BF16 gathers 2 B/param, NVFP4 gathers 0.5039 B/param of the packed weights (16x16 blocks), reduce-scatter 2 B."""
    nvfp4 = cli("explain", str(PRESETS[0].parent / "nvfp4_zero3.json"), "--model", "20m")
    assert nvfp4.returncode == 0, nvfp4.stderr
    # (12,042,240 x 0.50390625 + 7,444,864 x 2) = 21.0 MB per pass; reduce-scatter 19,487,104 x 2 = 39.0 MB
    assert "all-gather 2 x 21.0 MB (nvfp4: 12.0M packed params as codes + scales, 7.4M BF16), reduce-scatter " \
           "39.0 MB (bf16): 80.9 MB per step and rank, 48% of it reduce-scatter" in nvfp4.stdout, nvfp4.stdout
    bf16 = cli("explain", str(PRESETS[0].parent / "bf16_zero3.json"), "--model", "20m")
    assert "all-gather 2 x 39.0 MB (bf16: 19.5M params), reduce-scatter 39.0 MB" in bf16.stdout, bf16.stdout
    zero2 = cli("explain", str(PRESETS[0].parent / "nvfp4_zero2.json"), "--model", "20m")
    assert "ZeRO stage 2 all-reduces or reduce-scatters gradients only" in zero2.stdout
    hf = tmp_path / "tiny-llama"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000}))
    r = cli("explain", str(PRESETS[0].parent / "nvfp4_zero3.json"), "--model", str(hf))
    assert r.returncode == 0 and "llama from" in r.stdout and "nvfp4:" in r.stdout, r.stdout + r.stderr
    env = cli("env", "--config", str(PRESETS[0].parent / "nvfp4_zero3.json"), "--model", "20m")
    assert env.returncode == 0 and "traffic    ZeRO-3 per optimizer step and rank (reference GPT 20m" in env.stdout
    bad = cli("explain", str(PRESETS[0].parent / "nvfp4_zero3.json"), "--model", "7b")
    assert bad.returncode == 2 and "not a reference preset (1m, 5m" in bad.stderr
    assert cli("env", "--model", "20m").returncode == 2


def test_validate_checks_the_base_checkpoint_folder(tmp_path: Path) -> None:
    """``precision.base.checkpoint`` is checked as a fine-tune would load it, before any job starts."""
    from tests.checkpoint.tiny import llama_folder

    cfg = json.loads((PRESETS[0].parent / "nvfp4_zero3_lora.json").read_text())
    cfg["precision"]["base"]["checkpoint"] = str(tmp_path / "missing")
    f = write(tmp_path, "lora.json", json.dumps(cfg))
    r = cli("validate", f)
    assert r.returncode == 1 and "precision.base.checkpoint:" in r.stdout + r.stderr and "no such checkpoint folder" \
        in r.stdout + r.stderr
    llama_folder(tmp_path / "ckpt")
    cfg["precision"]["base"]["checkpoint"] = str(tmp_path / "ckpt")
    f = write(tmp_path, "lora.json", json.dumps(cfg))
    assert cli("validate", f).returncode == 0
