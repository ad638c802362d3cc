"""A tiny Llama and an NVFP4 folder of it, as `ds-nvfp4 export` writes one (export/formats.py): the Linears of each
fused inference GEMM (q/k/v, gate/up) share a global scale, lm_head stays BF16."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ds_nvfp4 import quantize
from ds_nvfp4.export.formats import compressed_tensors_config, modelopt_config, nvfp4_tensors

FORMATS = {"compressed-tensors": "nvfp4-compressed-tensors", "modelopt": "nvfp4-modelopt"}
VOCAB = 96


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]


def llama_folder(folder: Path, fmt: str = "compressed-tensors", seed: int = 0, model=None) -> dict[str, torch.Tensor]:
    """Write ``model`` (default tiny_llama(seed)) to ``folder`` in ``fmt``; returns every tensor written."""
    src = model if model is not None else tiny_llama(seed)
    sd = {k: v.detach().clone() for k, v in src.state_dict().items()}
    tensors, groups = {}, {}
    for n in linears(src):
        parent, _, leaf = n.rpartition(".")
        key = (parent, "qkv" if leaf in ("q_proj", "k_proj", "v_proj") else "mlp" if leaf in ("gate_proj", "up_proj")
               else leaf)
        groups.setdefault(key, []).append(n)
    for members in groups.values():
        amax = max(sd[f"{n}.weight"].abs().amax() for n in members)
        for n in members:
            tensors |= nvfp4_tensors(FORMATS[fmt], n, quantize(sd.pop(f"{n}.weight"), block="1x16", amax=amax),
                                     slice(None), None)
    tensors |= {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors")
    # a whole HF config: from_config builds the model from it
    config = {**src.config.to_dict(), "architectures": [type(src).__name__]}
    if fmt == "modelopt":
        (folder / "hf_quant_config.json").write_text(json.dumps(modelopt_config(["lm_head"], "W4A16")))
    else:
        config["quantization_config"] = compressed_tensors_config(["lm_head"])
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def decompressed_llama(tensors: dict[str, torch.Tensor], seed: int = 2):
    """tiny_llama with every weight of a compressed-tensors folder's ``tensors`` as compressed-tensors' own
    decompressor returns it (BF16)."""
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    ref = tiny_llama(seed).to(torch.bfloat16)
    scheme = QuantizationConfig.model_validate(compressed_tensors_config(["lm_head"])).config_groups["group_0"]
    quantized = set(linears(ref))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            module = name.removesuffix(".weight")
            if module in quantized:
                got = NVFP4PackedCompressor.decompress({k: tensors[f"{module}.{k}"] for k in
                                                        ("weight_packed", "weight_scale", "weight_global_scale")},
                                                       scheme)["weight"]
                p.copy_(got.to(torch.bfloat16))
            else:
                p.copy_(tensors[name])
    return ref
