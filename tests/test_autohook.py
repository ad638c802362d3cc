"""The start-up hook: installed by the package, light at interpreter start, routes only configs with ``precision``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import ds_nvfp4_autohook as hook

PROBE = ("import sys; print(json.dumps({'hook': 'ds_nvfp4_autohook' in sys.modules, 'torch': 'torch' in sys.modules,"
         " 'deepspeed': 'deepspeed' in sys.modules}))")


def python(code: str, **env: str) -> str:
    import os

    r = subprocess.run([sys.executable, "-c", f"import json; {code}"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "DS_ACCELERATOR": "cpu", **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_pth_file_is_installed_and_imports_nothing_heavy() -> None:
    site = [Path(p) for p in sys.path if p.endswith("site-packages")]
    assert any((p / "ds_nvfp4_autohook.pth").is_file() for p in site), f"no ds_nvfp4_autohook.pth in {site}"
    state = json.loads(python(PROBE))
    assert state == {"hook": True, "torch": False, "deepspeed": False}
    assert json.loads(python(PROBE, DS_NVFP4_AUTO="0"))["hook"] is False


def test_importing_deepspeed_wraps_initialize_once_keeping_its_signature() -> None:
    out = json.loads(python("import deepspeed, inspect; f = deepspeed.initialize; print(json.dumps({'wrapped': "
                            "hasattr(f, '__ds_nvfp4_original__'), 'params': list(inspect.signature(f).parameters), "
                            "'twice': hasattr(f.__ds_nvfp4_original__, '__ds_nvfp4_original__')}))"))
    assert out["wrapped"] and not out["twice"]
    assert out["params"][:3] == ["args", "model", "optimizer"] and "config" in out["params"]
    off = json.loads(python("import deepspeed; print(json.dumps(hasattr(deepspeed.initialize, "
                            "'__ds_nvfp4_original__')))", DS_NVFP4_AUTO="0"))
    assert off is False


def test_which_configs_are_routed(tmp_path: Path) -> None:
    with_section, without = tmp_path / "a.json", tmp_path / "b.json"
    with_section.write_text(json.dumps({"precision": {"enabled": False}}))
    without.write_text(json.dumps({"train_batch_size": 8, "note": "precision"}))
    broken = tmp_path / "c.json"
    broken.write_text('{"precision": {"enabled": true},}')
    assert hook.has_precision_section({"precision": {}}) and not hook.has_precision_section({"bf16": {}})
    assert hook.has_precision_section(with_section) and hook.has_precision_section(str(with_section))
    assert not hook.has_precision_section(without)
    assert hook.has_precision_section(broken)  # ds_nvfp4 reports the syntax error instead of DeepSpeed ignoring it
    assert not hook.has_precision_section(tmp_path / "missing.json")
    args = argparse.Namespace(deepspeed_config=str(with_section))
    import deepspeed

    ds_init = hook.original_initialize(deepspeed)

    def source(*a, **kw):
        return hook.config_source(hook.bind(ds_init, a, kw))

    # DeepSpeed's precedence: config, then config_params, then args.deepspeed_config (args positional or keyword)
    assert source(args) == ("args", str(with_section))
    assert source(args=args, model=None) == ("args", str(with_section))
    assert source(args=args, config={"x": 1}) == ("config", {"x": 1})
    assert source(config_params={"y": 1}) == ("config_params", {"y": 1})
    assert source(model=None) == (None, None)


def test_a_wheel_carries_the_pth_file_and_it_works_from_a_site_dir(tmp_path: Path) -> None:
    """The other install kind: ``pip wheel`` puts the .pth at the wheel's root, i.e. into site-packages."""
    import shutil
    import zipfile

    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "ds_nvfp4_autohook.py", "ds_nvfp4_autohook.pth"):
        shutil.copy2(root / name, src / name)
    shutil.copytree(root / "ds_nvfp4", src / "ds_nvfp4", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(tmp_path.glob("ds_nvfp4-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        assert z.read("ds_nvfp4_autohook.pth") == (root / "ds_nvfp4_autohook.pth").read_bytes()
        z.extract("ds_nvfp4_autohook.pth", tmp_path / "site")
        z.extract("ds_nvfp4_autohook.py", tmp_path / "site")
    # a fresh interpreter that skips the normal site-packages (-S) and ignores the caller's PYTHONPATH (-E: a
    # checkout on it would shadow the wheel's hook), then adds the wheel's files as a site dir
    code = (f"import site, sys; site.addsitedir({str(tmp_path / 'site')!r}); "
            "print('ds_nvfp4_autohook' in sys.modules, sys.modules['ds_nvfp4_autohook'].__file__)")
    r = subprocess.run([sys.executable, "-E", "-S", "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("True " + str(tmp_path)), (r.stdout, r.stderr)


def test_near_misses_of_precision_are_found_and_others_are_not() -> None:
    keys = ["precison", "Precision", "precision_config", "PRECISION ", "nvfp4_precision", "bf16", "zero_optimization",
            "prescale_gradients", "train_batch_size"]
    assert hook.near_misses(keys) == ["precison", "Precision", "precision_config", "PRECISION ", "nvfp4_precision"]
    assert hook.near_misses(["precision"]) == []


def test_the_old_storage_name_still_works_with_a_deprecation_warning() -> None:
    import pytest

    import ds_nvfp4

    with pytest.warns(DeprecationWarning, match="NVFP4Storage"):
        assert ds_nvfp4.NVFP4Tensor is ds_nvfp4.NVFP4Storage


def scenario_plain_initialize(rank: int, p: dict) -> dict:
    """An unmodified script: ``deepspeed.initialize`` (the wrapper the hook installed), three ds_configs."""
    import contextlib
    import io

    import deepspeed
    import torch

    from tests.zero.engines import Net, batch, config

    assert hasattr(deepspeed.initialize, "__ds_nvfp4_original__"), "the hook did not wrap deepspeed.initialize"
    out = {}
    plain = config()
    plain.pop("precision")
    near = dict(plain, precison={"enabled": True})  # a typo DeepSpeed would ignore
    for label, cfg in (("precision", config()), ("plain", plain), ("near_miss", near)):
        torch.manual_seed(0)
        model = Net()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x, y = batch(0, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out[label] = {"routed": hasattr(engine, "ds_nvfp4"), "loss": float(loss),
                      "warned": "trains WITHOUT NVFP4" in err.getvalue() and "'precison'" in err.getvalue()}
        engine.destroy()
    return out


def test_the_wrapper_routes_an_unmodified_scripts_configs_on_real_ranks() -> None:
    """What ``deepspeed.initialize`` becomes, called as a user's script calls it: a ds_config with ``precision``
    gets ds_nvfp4's engine, one without keeps DeepSpeed's own, and a near miss of the key trains plain DeepSpeed
    after a warning on rank 0's stderr (the other ranks stay quiet)."""
    from tests.ranks import run_ranks

    for r in run_ranks(scenario_plain_initialize, world_size=2):
        assert r["precision"]["routed"] and not r["plain"]["routed"] and not r["near_miss"]["routed"], r
        assert r["near_miss"]["warned"] is (r["rank"] == 0) and not r["plain"]["warned"], r
        assert all(r[k]["loss"] == r[k]["loss"] for k in ("precision", "plain", "near_miss")), r
