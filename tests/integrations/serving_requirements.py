"""What vLLM and TensorRT-LLM require of an NVFP4 checkpoint, as data, each with the loader file it comes from.

Neither installs here (no CUDA): these were read from their loaders' source (vLLM at commit 00155cd of
``vllm-project/vllm``; the config normalisation as in vLLM's ``vllm/config/model.py``). Every export is checked
against every requirement that applies to its format and scheme (``check_export``); docs/integrations.md renders
the same table.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

VLLM_MODELOPT = "vllm/model_executor/layers/quantization/modelopt.py"
VLLM_CONFIG = "vllm/config/model.py (_normalize_quantization_config)"
VLLM_CT = "vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a{4,16}_nvfp4.py"
VLLM_REGISTRY = "vllm/model_executor/models/registry.py"
TRTLLM_LINEAR = "tensorrt_llm/_torch/modules/linear.py (NVFP4 load_weights)"


@dataclass(frozen=True)
class Export:
    """An export folder, opened once: its tensors, configs and which layers are NVFP4."""

    path: Path
    fmt: str
    scheme: str
    tensors: dict[str, torch.Tensor]
    config: dict
    quant: dict            # hf_quant_config.json (ModelOpt) or config.json's quantization_config
    nvfp4: list[str]       # NVFP4 layer names
    bf16_linears: list[str]
    fused: list[list[str]]

    @classmethod
    def open(cls, path: Path, fmt: str, scheme: str, nvfp4: list[str], bf16_linears: list[str],
             fused: list[list[str]]) -> Export:
        from safetensors.torch import load_file

        config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
        quant = (json.loads((path / "hf_quant_config.json").read_text()) if fmt == "nvfp4-modelopt"
                 else config.get("quantization_config", {}))
        return cls(path, fmt, scheme, load_file(path / "model.safetensors"), config, quant, nvfp4, bf16_linears,
                   fused)


@dataclass(frozen=True)
class Requirement:
    consumer: str
    source: str
    text: str
    formats: tuple[str, ...]
    check: Callable[[Export], bool]


def _modelopt_excluded(name: str, patterns: list[str]) -> bool:
    """vLLM ModelOptQuantConfigBase.is_layer_excluded: exact, substring or fnmatch."""
    return any(p == name or p in name or fnmatch.fnmatchcase(name, p) for p in patterns)


def _shapes(e: Export, names: dict[str, tuple[torch.dtype, Callable[[int, int], tuple]]]) -> bool:
    for layer in e.nvfp4:
        n = int(e.tensors[f"{layer}.weight_scale"].shape[0])
        k = int(e.tensors[f"{layer}.weight_scale"].shape[1]) * 16
        for suffix, (dtype, shape) in names.items():
            t = e.tensors.get(f"{layer}.{suffix}")
            if t is None or t.dtype != dtype or t.numel() != math_prod(shape(n, k)):
                return False
            if len(shape(n, k)) == 2 and tuple(t.shape) != shape(n, k):
                return False
    return True


def math_prod(shape: tuple) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _equal_in_groups(e: Export, suffix: str) -> bool:
    return all(len({float(e.tensors[f"{m}.{suffix}"].reshape(-1)[0]) for m in g}) == 1 for g in e.fused)


MO, CT = ("nvfp4-modelopt",), ("nvfp4-compressed-tensors",)
REQUIREMENTS: list[Requirement] = [
    Requirement("vLLM", VLLM_REGISTRY, "config.json has `architectures` and `model_type` (model class selection)",
                MO + CT, lambda e: bool(e.config.get("architectures")) and bool(e.config.get("model_type"))),
    Requirement("vLLM", VLLM_CONFIG, 'ModelOpt: `producer.name == "modelopt"`, else the ModelOpt path is never '
                "selected", MO, lambda e: e.quant.get("producer", {}).get("name") == "modelopt"),
    Requirement("vLLM", VLLM_MODELOPT, 'ModelOpt: `quant_algo` is "NVFP4" (W4A4) or "W4A16_NVFP4" (weights only), '
                "matching the tensors written", MO,
                lambda e: e.quant["quantization"]["quant_algo"] == {"W4A4": "NVFP4", "W4A16": "W4A16_NVFP4"}[e.scheme]),
    Requirement("vLLM", VLLM_MODELOPT, "ModelOpt: `group_size`, `kv_cache_quant_algo`, `exclude_modules` present "
                "(ModelOptNvFp4Config._from_config raises otherwise); group_size 16", MO,
                lambda e: {"group_size", "kv_cache_quant_algo", "exclude_modules"} <= set(e.quant["quantization"])
                and e.quant["quantization"]["group_size"] == 16),
    Requirement("vLLM", VLLM_MODELOPT, "ModelOpt: `exclude_modules` (substring/fnmatch) matches every BF16 Linear "
                "and no NVFP4 layer", MO,
                lambda e: all(_modelopt_excluded(n, e.quant["quantization"]["exclude_modules"])
                              for n in e.bf16_linears)
                and not any(_modelopt_excluded(n, e.quant["quantization"]["exclude_modules"]) for n in e.nvfp4)),
    Requirement("vLLM", VLLM_MODELOPT, "ModelOpt tensors: `weight` uint8 [N, K/2], `weight_scale` float8_e4m3fn "
                "[N, K/16], `weight_scale_2` float32 scalar (amax/2688)", MO,
                lambda e: _shapes(e, {"weight": (torch.uint8, lambda n, k: (n, k // 2)),
                                      "weight_scale": (torch.float8_e4m3fn, lambda n, k: (n, k // 16)),
                                      "weight_scale_2": (torch.float32, lambda n, k: (1,))})),
    Requirement("vLLM", VLLM_MODELOPT, "ModelOpt W4A4: `input_scale` float32 scalar per layer (vLLM allocates it "
                "uninitialised when absent); none for W4A16", MO,
                lambda e: all((f"{n}.input_scale" in e.tensors) == (e.scheme == "W4A4") for n in e.nvfp4)
                and (e.scheme != "W4A4" or _shapes(e, {"input_scale": (torch.float32, lambda n, k: (1,))}))),
    Requirement("vLLM + TensorRT-LLM", f"{VLLM_MODELOPT}; {TRTLLM_LINEAR}", "fused q/k/v and gate/up share one "
                "`weight_scale_2` and one `input_scale` (vLLM takes the max and warns, TRT-LLM asserts equality)",
                MO, lambda e: _equal_in_groups(e, "weight_scale_2")
                and (e.scheme != "W4A4" or _equal_in_groups(e, "input_scale"))),
    Requirement("vLLM", VLLM_CT, 'compressed-tensors: quant_method "compressed-tensors", format '
                '"nvfp4-pack-quantized", weights float 4-bit tensor_group group 16 symmetric', CT,
                lambda e: e.quant["quant_method"] == "compressed-tensors"
                and e.quant["format"] == "nvfp4-pack-quantized"
                and all(g["weights"]["strategy"] == "tensor_group" and g["weights"]["group_size"] == 16
                        and g["weights"]["num_bits"] == 4 and g["weights"]["type"] == "float"
                        and g["weights"]["symmetric"] for g in e.quant["config_groups"].values())),
    Requirement("vLLM", VLLM_CT, "compressed-tensors: `input_activations` NVFP4 (tensor_group, 16) for W4A4, "
                "null for W4A16 (selects the w4a4 vs w4a16 scheme)", CT,
                lambda e: all((g["input_activations"] is not None) == (e.scheme == "W4A4")
                              for g in e.quant["config_groups"].values())),
    Requirement("vLLM", VLLM_CT, "compressed-tensors tensors: `weight_packed` uint8 [N, K/2], `weight_scale` "
                "float8_e4m3fn [N, K/16], `weight_global_scale` float32 [1] (divisor 2688/amax); "
                "`input_global_scale` float32 [1] for W4A4", CT,
                lambda e: _shapes(e, {"weight_packed": (torch.uint8, lambda n, k: (n, k // 2)),
                                      "weight_scale": (torch.float8_e4m3fn, lambda n, k: (n, k // 16)),
                                      "weight_global_scale": (torch.float32, lambda n, k: (1,)),
                                      **({"input_global_scale": (torch.float32, lambda n, k: (1,))}
                                         if e.scheme == "W4A4" else {})})),
    Requirement("vLLM", VLLM_CT, "compressed-tensors: `ignore` lists every BF16 Linear", CT,
                lambda e: set(e.bf16_linears) <= set(e.quant["ignore"]) and not set(e.nvfp4) & set(e.quant["ignore"])),
    Requirement("vLLM + TensorRT-LLM", f"{VLLM_CT}; {TRTLLM_LINEAR}", "fused q/k/v and gate/up share one "
                "`weight_global_scale` (and `input_global_scale`)", CT,
                lambda e: _equal_in_groups(e, "weight_global_scale")
                and (e.scheme != "W4A4" or _equal_in_groups(e, "input_global_scale"))),
]


def check_export(e: Export) -> list[str]:
    """The requirements this export fails (empty: all met)."""
    return [f"{r.consumer} ({r.source}): {r.text}" for r in REQUIREMENTS if e.fmt in r.formats and not r.check(e)]
