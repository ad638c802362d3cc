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
    assert r.stdout.count(": ok") == len(PRESETS) == 6


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
                                            ("nvfp4_full_zero3.json", "Fprop, Dgrad and Wgrad"),
                                            ("nvfp4_full_zero3.json", "steps 1-50: every converted layer in BF16 "
                                                                      "(BF16 weights); steps 51 on: fp4"),
                                            ("nvfp4_zero2.json", "stored by DeepSpeed in BF16"),
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
