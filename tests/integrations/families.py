"""Tiny transformers models of every family the MoE and Conv1D support is tested on, built from configs (no
download). Dimensions are multiples of 16 and split evenly over 2 ranks in 16-row tiles (packed ZeRO-3)."""

from __future__ import annotations

#: family -> (config class, model class, config keyword arguments)
FAMILIES = {
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64, "intermediate_size": 128, "decoder_sparse_step": 1}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128,
                   "head_dim": 16, "decoder_sparse_step": 1}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "n_shared_experts": 1, "intermediate_size": 128, "first_k_dense_replace": 1, "n_group": 2,
                     "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
                     "qk_nope_head_dim": 16, "v_head_dim": 16, "num_key_value_heads": 4}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64}),
}

_COMMON = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 64}


def config(name: str):
    import transformers

    cfg_cls, _, kw = FAMILIES[name]
    common = {"vocab_size": 256} if name == "gpt2" else _COMMON
    cfg = getattr(transformers, cfg_cls)(**{**common, **kw, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    cfg._experts_implementation = "eager"  # what the FP4 class replaces is the eager loop (any choice would do)
    return cfg


def build(name: str):
    """A tiny model of ``name``: from the table above, else from the registry-driven builder (tests/integrations/
    moe_families.py: hidden 64, 4 experts of width 32), e.g. ``gpt_oss``, ``dbrx``, ``llama4_text``."""
    import torch
    import transformers

    if name not in FAMILIES:
        from tests.integrations.moe_families import build as build_any

        return build_any(name)
    torch.manual_seed(0)
    return getattr(transformers, FAMILIES[name][1])(config(name))
