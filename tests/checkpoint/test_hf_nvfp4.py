"""Published NVFP4 checkpoints (checkpoint/hf_nvfp4.py): both layouts read back exactly as written, row ranges read
alone, and every kind of bad input refused by one error naming the tensor and the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds_nvfp4 import quantize
from ds_nvfp4.checkpoint import CheckpointError
from ds_nvfp4.checkpoint.hf_nvfp4 import open_nvfp4_checkpoint
from ds_nvfp4.export.formats import compressed_tensors_config, modelopt_config, nvfp4_tensors
from tests.checkpoint.tiny import decompressed_llama, linears, llama_folder
from tests.checkpoint.tiny import tiny_llama as _tiny_llama

ATTN = "model.layers.0.self_attn"
FORMATS = {"compressed-tensors": "nvfp4-compressed-tensors", "modelopt": "nvfp4-modelopt"}


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"{ATTN}.q_proj": torch.randn(32, 64, generator=g), f"{ATTN}.k_proj": torch.randn(16, 64, generator=g) * 3,
            f"{ATTN}.v_proj": torch.randn(16, 64, generator=g), "model.layers.0.mlp.down_proj":
            torch.randn(64, 32, generator=g) * 0.02}


def quantized() -> dict[str, object]:
    w = weights()
    shared = max(w[f"{ATTN}.{p}"].abs().amax() for p in ("q_proj", "k_proj", "v_proj"))  # one fused GEMM
    return {n: quantize(t, block="1x16", amax=shared if "self_attn" in n else t.abs().amax()) for n, t in w.items()}


def write(folder: Path, fmt: str, shards: int = 1) -> dict[str, object]:
    """An NVFP4 folder in ``fmt`` as ``ds-nvfp4 export`` writes it (export/formats.py), lm_head kept BF16."""
    folder.mkdir()
    q = quantized()
    tensors = {"lm_head.weight": torch.randn(8, 64).to(torch.bfloat16)}
    for name, storage in q.items():
        tensors |= nvfp4_tensors(FORMATS[fmt], name, storage, slice(None), None)
    config = {"model_type": "llama"}
    if fmt == "modelopt":
        (folder / "hf_quant_config.json").write_text(json.dumps(modelopt_config(["lm_head"], "W4A16")))
    else:
        config["quantization_config"] = compressed_tensors_config(["lm_head"])
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, folder / "model.safetensors")
    else:  # the attention in one shard, the rest in the other
        parts = [{k: v for k, v in tensors.items() if (ATTN in k) == (i == 0)} for i in range(2)]
        files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
        for part, f in zip(parts, files):
            save_file(part, folder / f)
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: f for part, f in zip(parts, files) for k in part}}))
    return q


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_both_layouts_read_back_exactly_as_written(tmp_path: Path, fmt: str, shards: int) -> None:
    q = write(tmp_path / "ckpt", fmt, shards)
    ckpt = open_nvfp4_checkpoint(tmp_path / "ckpt")
    assert ckpt.format == fmt and ckpt.ignore == ["lm_head"] and set(ckpt.weights) == set(q)
    for name, want in q.items():
        got = ckpt.read(name)
        assert torch.equal(got.data, want.data), name
        assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8)), name
        # the global scale travels as amax/2688 or 2688/amax in float32: the amax comes back within an ulp
        torch.testing.assert_close(got.amax, want.amax, rtol=2**-23, atol=0)
        torch.testing.assert_close(got.dequantize(torch.float32), want.dequantize(torch.float32), rtol=2**-22, atol=0)


def test_a_row_range_is_those_rows(tmp_path: Path) -> None:
    q = write(tmp_path / "ckpt", "compressed-tensors")
    part = open_nvfp4_checkpoint(tmp_path / "ckpt").read("model.layers.0.mlp.down_proj", rows=slice(16, 48))
    whole = q["model.layers.0.mlp.down_proj"]
    assert part.shape == (32, 32) and torch.equal(part.data, whole.data[16:48])
    assert torch.equal(part.scale.view(torch.uint8), whole.scale[16:48].view(torch.uint8))


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg["quantization_config"]
    for path, value in changes.items():
        node = qc
        *keys, last = path.split("/")
        for k in keys:
            node = node[k]
        node[last] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def _retensor(folder: Path, name: str, value: torch.Tensor) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors[name] = value
    save_file(tensors, folder / "model.safetensors")


def _bad(kind: str, folder: Path) -> None:
    if kind == "fp8":
        _edit_config(folder, format="float-quantized", **{"config_groups/group_0/weights/num_bits": 8})
    elif kind == "int4":
        _edit_config(folder, format="pack-quantized", **{"config_groups/group_0/weights/type": "int"})
    elif kind == "bf16":
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif kind == "group_size":
        _edit_config(folder, **{"config_groups/group_0/weights/group_size": 32})
    elif kind == "truncated":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    elif kind == "scale_shape":
        _retensor(folder, "model.layers.0.mlp.down_proj.weight_scale", torch.zeros(64, 3).to(torch.float8_e4m3fn))
    elif kind == "fused_scales":
        _retensor(folder, f"{ATTN}.k_proj.weight_global_scale", torch.tensor([1.0]))
    elif kind == "codes_dtype":
        _retensor(folder, f"{ATTN}.q_proj.weight_packed", torch.zeros(32, 32, dtype=torch.int8))


@pytest.mark.parametrize("kind, needles", [
    ("fp8", ["config.json", "'float-quantized'", "not NVFP4"]),
    ("int4", ["config.json", "'pack-quantized'", "not NVFP4"]),
    ("bf16", ["config.json", "no quantization_config", "not NVFP4"]),
    ("group_size", ["config.json", "group_0.weights.group_size is 32", "allowed: 16"]),
    ("truncated", ["model.safetensors", "truncated"]),
    ("scale_shape", ["model.safetensors", "down_proj.weight_scale has shape [64, 3], expected [64, 2]"]),
    ("fused_scales", ["model.safetensors", "q_proj", "k_proj", "different global scales"]),
    ("codes_dtype", ["model.safetensors", "q_proj.weight_packed is I8, expected U8"]),
])
def test_bad_input_is_one_error_naming_the_tensor_and_the_file(tmp_path: Path, kind: str, needles: list[str]) -> None:
    folder = tmp_path / "ckpt"
    write(folder, "compressed-tensors")
    _bad(kind, folder)
    with pytest.raises(CheckpointError) as err:
        open_nvfp4_checkpoint(folder)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_a_missing_shard_and_a_modelopt_algorithm_other_than_nvfp4(tmp_path: Path) -> None:
    write(tmp_path / "a", "compressed-tensors", shards=2)
    (tmp_path / "a" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=re.escape("model-00002-of-00002.safetensors: missing")):
        open_nvfp4_checkpoint(tmp_path / "a")
    write(tmp_path / "b", "modelopt")
    cfg = json.loads((tmp_path / "b" / "hf_quant_config.json").read_text())
    cfg["quantization"]["quant_algo"] = "FP8"
    (tmp_path / "b" / "hf_quant_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json: quantization.quant_algo is 'FP8', not NVFP4"):
        open_nvfp4_checkpoint(tmp_path / "b")


def test_continued_training_starts_from_the_logits_of_compressed_tensors_own_reader(tmp_path: Path) -> None:
    """A tiny Llama's Linears written NVFP4 (compressed-tensors, fused q/k/v and gate/up sharing their global
    scale, lm_head BF16), loaded into a fresh model: its weights and logits equal those of the same model with the
    weights compressed-tensors' own decompressor returns."""
    from ds_nvfp4.checkpoint.hf_nvfp4 import load_dequantized

    tensors = llama_folder(tmp_path / "ckpt")
    model = _tiny_llama(1).to(torch.bfloat16)
    report = load_dequantized(model, open_nvfp4_checkpoint(tmp_path / "ckpt"))
    assert len(report.from_codes) == len(linears(model)) == 14 and "lm_head.weight" in report.as_stored
    ref = decompressed_llama(tensors)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_a_model_the_checkpoint_does_not_fit_is_refused_unchanged(tmp_path: Path) -> None:
    from ds_nvfp4.checkpoint.hf_nvfp4 import load_dequantized

    write(tmp_path / "ckpt", "compressed-tensors")
    model = _tiny_llama(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=re.escape("has no tensor for the model's parameter model.embed_tokens")):
        load_dequantized(model, open_nvfp4_checkpoint(tmp_path / "ckpt"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_cli_checks_a_folder(tmp_path: Path) -> None:
    import subprocess
    import sys

    write(tmp_path / "ok", "modelopt")
    run = [sys.executable, "-m", "ds_nvfp4", "checkpoint"]
    r = subprocess.run([*run, str(tmp_path / "ok")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "NVFP4 (modelopt), 4 quantized weights" in r.stdout and "lm_head" in r.stdout
    write(tmp_path / "bad", "compressed-tensors")
    _bad("scale_shape", tmp_path / "bad")
    r = subprocess.run([*run, str(tmp_path / "bad"), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "down_proj.weight_scale has shape [64, 3]" in json.loads(r.stdout)["error"]


def scenario_load_under_zero3(rank: int, p: dict) -> dict:
    import deepspeed

    from ds_nvfp4.checkpoint.hf_nvfp4 import load_dequantized

    ckpt = open_nvfp4_checkpoint(p["folder"])
    plain = _tiny_llama(1)
    load_dequantized(plain, ckpt)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = _tiny_llama(2)
    partitioned = all(hasattr(q, "ds_id") and q.numel() == 0 for q in model.parameters())
    load_dequantized(model, ckpt)
    equal = {}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            equal[name] = bool(torch.equal(a, b)) or f"differs by {float((a - b).abs().max())}"
    return {"partitioned": partitioned, "equal": equal}


@pytest.mark.slow
def test_the_loader_sets_zero3_partitioned_parameters_on_real_ranks(tmp_path: Path) -> None:
    """Under ``zero.Init`` on 2 ranks every parameter ends equal to the one a plain model gets."""
    from tests.ranks import run_ranks

    src = _tiny_llama(0)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in src.state_dict().items()}
    for n, m in src.named_modules():
        if isinstance(m, torch.nn.Linear) and n.endswith(("o_proj", "down_proj")):  # unfused: own global scales
            del tensors[f"{n}.weight"]
            tensors |= nvfp4_tensors("nvfp4-compressed-tensors", n, quantize(m.weight.detach(), block="1x16"),
                                     slice(None), None)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": compressed_tensors_config(["lm_head"])}))
    for r in run_ranks(scenario_load_under_zero3, world_size=2, folder=str(folder)):
        assert r["partitioned"] and r["equal"] and all(v is True for v in r["equal"].values()), r
