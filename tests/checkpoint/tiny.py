"""A tiny Llama and an NVFP4 folder of it, as `ds-nvfp4 export` writes one (export/formats.py): the Linears of each
fused inference GEMM (q/k/v, gate/up) share a global scale, lm_head stays BF16; a tiny Qwen3-MoE and a folder of it
with per-expert names, as vLLM and llm-compressor name MoE checkpoints."""

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


def tiny_qwen3_moe(seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64)).eval()


def moe_folder(folder: Path, model, bf16_experts_layer: int | None = None) -> dict[str, torch.Tensor]:
    """An NVFP4 folder of a Qwen3-MoE model as vLLM and llm-compressor name MoE checkpoints: attention NVFP4 (q/k/v
    sharing a global scale), each expert's ``gate_proj`` / ``up_proj`` (one shared global scale) and ``down_proj``
    NVFP4 under per-expert names, the rest (router, norms, embeddings, lm_head) BF16. Written from what Qwen3-MoE
    stores (``gate_up_proj[e]`` is gate's rows then up's), not from ds_nvfp4's layout records; the experts of
    ``bf16_experts_layer`` are written BF16 under the same per-expert names (a checkpoint's ignore). Returns every
    attention and per-expert matrix as compressed-tensors' own decompressor reads it back (BF16), by module name,
    and the BF16 tensors as stored by parameter name."""
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    scheme = QuantizationConfig.model_validate(compressed_tensors_config(["lm_head"])).config_groups["group_0"]
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tensors, expect = {}, {}
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn"
        amax = max(sd[f"{attn}.{p}.weight"].abs().amax() for p in ("q_proj", "k_proj", "v_proj"))
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = sd.pop(f"{attn}.{p}.weight")
            mine = nvfp4_tensors("nvfp4-compressed-tensors", f"{attn}.{p}",
                                 quantize(w, block="1x16", amax=amax if p != "o_proj" else None), slice(None), None)
            tensors |= mine
            expect[f"{attn}.{p}"] = NVFP4PackedCompressor.decompress(
                {k.rpartition(".")[2]: v for k, v in mine.items()}, scheme)["weight"].to(torch.bfloat16)
        site = f"model.layers.{layer}.mlp.experts"
        gate_up, down = sd.pop(f"{site}.gate_up_proj"), sd.pop(f"{site}.down_proj")
        for e in range(4):
            gate, up = gate_up[e, :32], gate_up[e, 32:]
            shared = torch.maximum(gate.abs().amax(), up.abs().amax())
            for name, w, a in (("gate_proj", gate, shared), ("up_proj", up, shared), ("down_proj", down[e], None)):
                if layer == bf16_experts_layer:
                    tensors[f"{site}.{e}.{name}.weight"] = w.to(torch.bfloat16).contiguous()
                    expect[f"{site}.{e}.{name}"] = w.to(torch.bfloat16)
                    continue
                q = quantize(w.contiguous(), block="1x16", amax=a)
                mine = nvfp4_tensors("nvfp4-compressed-tensors", f"{site}.{e}.{name}", q, slice(None), None)
                tensors |= mine
                expect[f"{site}.{e}.{name}"] = NVFP4PackedCompressor.decompress(
                    {k.rpartition(".")[2]: v for k, v in mine.items()}, scheme)["weight"].to(torch.bfloat16)
    tensors |= {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
    expect |= {k: v.to(torch.bfloat16) for k, v in sd.items()}
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**model.config.to_dict(),
                                                    "quantization_config": compressed_tensors_config(["lm_head"])}))
    return expect


def decompressed_moe(expect: dict[str, torch.Tensor], seed: int = 2):
    """tiny_qwen3_moe with every tensor of a :func:`moe_folder` as compressed-tensors' own decompressor reads it
    (BF16): the attention weights, each expert's rows in the fused parameters, the rest as stored."""
    ref = tiny_qwen3_moe(seed).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            site, _, pname = name.rpartition(".")
            if site.endswith(".experts"):
                parts = ("gate_proj", "up_proj") if pname == "gate_up_proj" else ("down_proj",)
                p.copy_(torch.stack([torch.cat([expect[f"{site}.{e}.{q}"] for q in parts]) for e in range(4)]))
            else:
                p.copy_(expect.get(name.removesuffix(".weight"), expect.get(name)))
    return ref
