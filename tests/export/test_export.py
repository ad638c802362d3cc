"""`ds-nvfp4 export`: each format reloaded (compressed-tensors by its own library) equals the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli_in_process import run_cli
from tests.ranks import run_ranks
from tests.reference import VALUES, expand, ref_dequantize, ref_quantize
from tests.zero.engines import scenario_save

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("export") / "ckpt"
    run_ranks(scenario_save, dir=str(ckpt), dump_forward_weights=str(ckpt.parent / "forward_weights.pt"))
    return ckpt


def test_bf16_export_is_what_the_forward_multiplied(checkpoint: Path, tmp_path: Path) -> None:
    """Independent of the export's own reader: the weights gathered for the training forward, bit for bit."""
    seen = torch.load(checkpoint.parent / "forward_weights.pt")
    assert run_cli("export", str(checkpoint), str(tmp_path), "--format", "bf16").returncode == 0
    out = load_file(tmp_path / "model.safetensors")
    meta = json.loads((checkpoint / "step3" / "ds_nvfp4.json").read_text())
    assert meta["stored_bf16"] == ["odd"] and len(seen) == 8  # odd's 24-row partitions cut 16x16 tiles
    for name, w in seen.items():
        # a packed weight is gathered already quantized; a BF16-stored one is quantized by the forward itself
        want = w if name not in meta["stored_bf16"] else reference_bf16(w, "16x16")
        assert torch.equal(out[f"{name}.weight"], want), name


@pytest.fixture(scope="module")
def masters(checkpoint: Path) -> tuple[dict, dict]:
    from ds_nvfp4.export import load_run

    sd, meta = load_run(checkpoint)
    # what each layer's forward quantized: the FP32 master when packed, its BF16 copy when stored BF16
    sd = {k: v.to(torch.bfloat16).float() if k.removesuffix(".weight") in meta.stored_bf16 else v
          for k, v in sd.items()}
    return sd, meta.nvfp4_layers()


def reference(w: torch.Tensor, block: str):
    return ref_quantize(w, block, amax=w.abs().max())


def reference_bf16(w: torch.Tensor, block: str) -> torch.Tensor:
    packed, sb, amax = reference(w.float(), block)
    return ref_dequantize(packed, sb, amax, block).to(torch.bfloat16)


def test_layers_from_metadata(masters) -> None:
    _, layers = masters
    assert set(layers) == {f"blocks.{i}.fc{j}" for i in range(3) for j in (1, 2)} | {"odd", "mix"}


def test_bf16_export(checkpoint: Path, masters, tmp_path: Path) -> None:
    sd, layers = masters
    r = run_cli("export", str(checkpoint), str(tmp_path), "--format", "bf16")
    assert r.returncode == 0, r.stderr
    out = load_file(tmp_path / "model.safetensors")
    for key, w in sd.items():
        layer = key.removesuffix(".weight")
        if layer in layers and key.endswith(".weight"):
            packed, sb, amax = reference(w, layers[layer])
            assert torch.equal(out[key], ref_dequantize(packed, sb, amax, layers[layer]).to(torch.bfloat16)), key
        else:
            assert torch.equal(out[key], w.to(torch.bfloat16)), key


def test_modelopt_export(checkpoint: Path, masters, tmp_path: Path) -> None:
    sd, layers = masters
    assert run_cli("export", str(checkpoint), str(tmp_path), "--format", "nvfp4-modelopt").returncode == 0
    out = load_file(tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "NVFP4" and "lm_head" in cfg["quantization"]["exclude_modules"]
    for layer, block in layers.items():
        packed, sb, amax = reference(sd[f"{layer}.weight"], block)
        assert torch.equal(out[f"{layer}.weight"], packed)
        assert torch.equal(out[f"{layer}.weight_scale"].view(torch.uint8), expand(sb.to(torch.float32), block)[:, ::16]
                           .to(torch.float8_e4m3fn).view(torch.uint8))
        assert torch.equal(out[f"{layer}.weight_scale_2"], amax / 2688)
        # ModelOpt's dequantization: e2m1 * weight_scale * weight_scale_2
        codes = torch.stack([packed % 16, packed // 16], -1).reshape(packed.shape[0], -1)
        deq = VALUES[codes.long()] * expand(out[f"{layer}.weight_scale"].float()[:, :, None].squeeze(-1), "1x16")
        deq = deq * out[f"{layer}.weight_scale_2"]
        want = ref_dequantize(packed, sb, amax, block)
        torch.testing.assert_close(deq, want, rtol=4 * 2**-23, atol=0)
    # W4A4: the static activation scale is the decode form amax/2688 of the input amax training agreed on
    for layer, want in _input_amax(checkpoint).items():
        assert out[f"{layer}.input_scale"].dtype == torch.float32
        assert float(out[f"{layer}.input_scale"]) == pytest.approx(want / 2688, rel=1e-6), layer


def _input_amax(checkpoint: Path) -> dict[str, float]:
    """Per NVFP4 layer, the input amax of ds_nvfp4.json, shared within a fused group (one input per fused GEMM)."""
    meta = json.loads((checkpoint / "step3" / "ds_nvfp4.json").read_text())
    amax = {n: v for n, v in meta["input_amax"].items() if v}
    for group in meta["conversion"]["fused_groups"]:
        shared = max(amax[n] for n in group)
        amax.update(dict.fromkeys(group, shared))
    assert amax and all(v > 0 for v in amax.values())
    return amax


def test_compressed_tensors_export_reloads_with_the_library(checkpoint: Path, masters, tmp_path: Path) -> None:
    import compressed_tensors as ct  # a dev dependency: missing it is an error, not a skip
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    sd, layers = masters
    assert run_cli("export", str(checkpoint), str(tmp_path), "--format", "nvfp4-compressed-tensors").returncode == 0
    out = load_file(tmp_path / "model.safetensors")
    qc = QuantizationConfig.model_validate(json.loads((tmp_path / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    for layer, block in layers.items():
        got = NVFP4PackedCompressor.decompress({k: out[f"{layer}.{k}"] for k in
                                                ("weight_packed", "weight_scale", "weight_global_scale")}, scheme)
        packed, sb, amax = reference(sd[f"{layer}.weight"], block)
        want = ref_dequantize(packed, sb, amax, block).to(torch.bfloat16)
        assert torch.equal(got["weight"].to(torch.bfloat16), want), (layer, ct.__version__)
    # W4A4: the encode form 2688/amax of the recorded input amax (vLLM takes its reciprocal), fp32 [1]
    for layer, want in _input_amax(checkpoint).items():
        got = out[f"{layer}.input_global_scale"]
        assert got.dtype == torch.float32 and got.shape == (1,)
        assert float(got) == pytest.approx(2688 / want, rel=1e-6), layer


def test_export_errors(checkpoint: Path, tmp_path: Path) -> None:
    r = run_cli("export", str(tmp_path / "nope"), str(tmp_path / "out"), "--format", "bf16")
    assert r.returncode == 2 and "not a directory" in r.stderr
    (tmp_path / "ck" / "t1").mkdir(parents=True)
    (tmp_path / "ck" / "t1" / "mp_rank_00_model_states.pt").write_bytes(b"")
    r = run_cli("export", str(tmp_path / "ck"), str(tmp_path / "out"), "--format", "bf16", "--tag", "t1")
    assert r.returncode == 2 and "ds_nvfp4.json: missing" in r.stderr
    # a missing tag lists the tags that exist
    r = run_cli("export", str(checkpoint), str(tmp_path / "out"), "--format", "bf16", "--tag", "step9")
    assert r.returncode == 2 and "no checkpoint tag 'step9'" in r.stderr and "step3" in r.stderr, r.stderr
    # OUT is a file: a clear error, the file untouched
    (tmp_path / "file").write_text("keep")
    r = run_cli("export", str(checkpoint), str(tmp_path / "file"), "--format", "bf16")
    assert r.returncode == 2 and "is a file" in r.stderr and (tmp_path / "file").read_text() == "keep"
    # an existing non-empty OUT is refused; --force replaces it whole (no stale config.json left behind)
    out = tmp_path / "existing"
    out.mkdir()
    (out / "config.json").write_text("{}")
    r = run_cli("export", str(checkpoint), str(out), "--format", "nvfp4-modelopt")
    assert r.returncode == 2 and "not empty" in r.stderr and "--force" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    r = run_cli("export", str(checkpoint), str(out), "--format", "nvfp4-modelopt", "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["hf_quant_config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folders left behind"
