"""Every causal-LM family of the installed transformers that has experts, built tiny from its own config class.

The families come from transformers' registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and the config classes), not
from a hand list: a family has experts when its default config (or a sub-config) sets a number of experts above 1.
Each is shrunk generically (hidden 64, 4 layers, 4 experts of width 32, top-2, vocabulary 256; per-layer lists cut to
the first 4 layers) with the few family-specific fixes in ``FIXES``; one that still cannot be built or run on CPU is
reported with the reason (``build`` raises :class:`Unbuildable`), never silently dropped.
"""

from __future__ import annotations

import re

LAYERS = 4

#: config key (regex, full match) -> tiny value; applied to the config and every sub-config dict
_SIZES = (
    (r"hidden_size|d_model|n_embd|embed_dim", 64),
    (r"num_hidden_layers|n_layers?|num_layers", LAYERS),
    (r"num_attention_heads|n_heads?|num_heads", 4),
    (r"num_key_value_heads|n_kv_heads|num_kv_heads", 2),
    (r"head_dim", 16),
    (r".*intermediate_size|ffn_hidden_size|expert_ffn_hidden_size|moe_intermediate_size", 32),
    (r"num_experts|num_local_experts|n_routed_experts|moe_num_experts", 4),
    (r"num_experts_per_tok|num_experts_per_token|top_k_experts|moe_top_k|moe_k", 2),
    (r"vocab_size", 256),
    (r"max_position_embeddings", 128),
    (r"first_k_dense_replace", 1),
    (r"decoder_sparse_step|moe_layer_freq", 1),
    (r"n_group|num_expert_group", 1),
    (r"topk_group", 1),
    (r"n_shared_experts|num_shared_experts|moe_num_shared_experts", 1),
    (r"q_lora_rank|kv_lora_rank", 32),
    (r"qk_rope_head_dim|qk_nope_head_dim|v_head_dim", 16),
)
#: family -> extra config keywords the generic shrink cannot guess (each with why)
FIXES: dict[str, dict] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "zaya": {"num_experts_per_tok": 1},                       # ZAYA routes to one expert only
    "doge": {"is_moe": True},                                 # Doge builds its experts only when asked
    "deepseek_v2": {"num_experts_per_tok": 2},                # its default leaves top-k unset
    "kolibri1_1": {"index_layers": [1, 3]},                   # its indexed-attention layers must exist
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 16},  # Mamba heads x head dim = 2 x hidden
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    # DBRX: its sub-configs default without rope_theta and with clip_qkv None, which its attention clamps with
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}, "max_seq_len": 128,
             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}},
}
_EXPERT_COUNT = re.compile(r"(num|n)_(local_|routed_)?experts|moe_num_experts|num_experts")


class Unbuildable(Exception):
    """The family cannot be built tiny on CPU; the message says why."""


def _has_experts(d: dict) -> bool:
    for k, v in d.items():
        if isinstance(v, dict) and _has_experts(v):
            return True
        if isinstance(k, str) and _EXPERT_COUNT.fullmatch(k) and isinstance(v, int) and not isinstance(v, bool) \
                and v > 1:
            return True
    return False


def moe_families() -> dict[str, tuple[str, str]]:
    """``{model_type: (config class, causal-LM class)}`` of every registered family whose config has experts."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for model_type, model_cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        cfg_name = CONFIG_MAPPING_NAMES.get(model_type)
        if cfg_name is None or not hasattr(transformers, cfg_name) or not hasattr(transformers, model_cls):
            continue
        try:
            d = getattr(transformers, cfg_name)().to_dict()
        except Exception:  # a config without defaults: it is tried (and reported) by build()
            d = {"num_experts": 2}
        if _has_experts(d):
            out[model_type] = (cfg_name, model_cls)
    return dict(sorted(out.items()))


def _shrink(d: dict, layers_before: int | None) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, bool) or not isinstance(k, str):
            continue
        if isinstance(v, int):
            for pattern, value in _SIZES:
                if re.fullmatch(pattern, k):
                    out[k] = min(v, value) if k in ("first_k_dense_replace",) else value
                    break
        elif isinstance(v, list) and layers_before and len(v) == layers_before:
            out[k] = v[:LAYERS]
        elif isinstance(v, dict) and v and all(isinstance(x, int) or (isinstance(x, str) and x.isdigit()) for x in v):
            out[k] = {x: y for x, y in v.items() if int(x) < LAYERS}
        elif isinstance(v, dict):
            sub = _shrink(v, _layers(v) or layers_before)  # a sub-config (text_config) counts its own layers
            if sub:
                out[k] = {**v, **sub}
    return out


def _layers(d: dict) -> int | None:
    return next((d[k] for k in ("num_hidden_layers", "n_layers", "n_layer", "num_layers") if isinstance(d.get(k), int)),
                None)


def config(model_type: str):
    import transformers

    cfg_name, _ = moe_families()[model_type]
    cls = getattr(transformers, cfg_name)
    try:
        d = cls().to_dict()
        kw = {**_shrink(d, _layers(d)), **FIXES.get(model_type, {})}
        if "kv_lora_rank" in d:  # multi-head latent attention: as many KV heads as query heads
            kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(d.get(k), int):
                kw[k] = min(d[k], 255)
        cfg = cls(**{**d, **kw})
    except Exception as exc:
        raise Unbuildable(f"{cfg_name} cannot be shrunk generically: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}") from exc
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    return cfg


def build(model_type: str):
    """A tiny model of ``model_type`` (seed 0), or :class:`Unbuildable` with the reason."""
    import torch
    import transformers

    cfg = config(model_type)
    torch.manual_seed(0)
    try:
        return getattr(transformers, moe_families()[model_type][1])(cfg)
    except Exception as exc:
        raise Unbuildable(f"{moe_families()[model_type][1]} does not build from the tiny config: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}") from exc
