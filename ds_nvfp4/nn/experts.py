"""FP4 GEMMs for Mixture-of-Experts experts as transformers 5 stores them: 3-D parameters, one matrix per expert.

An experts module (``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``MixtralExperts``, ``OlmoeExperts``,
``DeepseekV3Experts``, ... : the classes ``transformers.integrations.moe.use_experts_implementation`` decorates) holds
``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]`` (``up_proj [E, I, H]`` without a
gate; ``[E, K, N]`` when the class says ``is_transposed``) and is called as ``experts(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k])`` by its MoE block, after the router (which stays BF16).

Why a class swap and not an ``"nvfp4"`` entry of transformers' experts registry: the registry is chosen model-wide
(``config._experts_implementation``), while ``precision.modules`` decides per module (first and last blocks BF16),
and a later ``model.set_experts_implementation(...)`` would switch FP4 off without a word. The swapped class keeps
the module's parameters, state_dict keys (ZeRO-3 partitioning, checkpoints, ``save_pretrained``) and its own routing
inputs; with every GEMM BF16 (a schedule phase) it calls the class's own forward, i.e. the configured
implementation.

Each expert's GEMMs are exactly ``NVFP4Linear``'s (the same ops, bit for bit per expert), with one per-tensor amax per
expert matrix: gate and up of an expert are one matrix, so they share it, as a fused group would.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .linear import fp4_forward
from .module import FP4Module
from .recipe import Recipe
from .weights import WeightCodes


def _sites(m: nn.Module) -> tuple[str, str] | None:
    """The (first, second) GEMM parameter names of an experts module, or None when ``m`` is not one."""
    first = "gate_up_proj" if getattr(m, "has_gate", True) else "up_proj"
    params = [getattr(m, n, None) for n in (first, "down_proj")]
    if not all(isinstance(p, torch.Tensor) and len(getattr(p, "ds_shape", p.shape)) == 3 for p in params):
        return None
    if not hasattr(m, "num_experts") or not hasattr(m, "act_fn"):
        return None
    return first, "down_proj"


def is_experts(m: nn.Module) -> bool:
    return _sites(m) is not None


def _shape(p: torch.Tensor) -> tuple[int, int, int]:
    return tuple(getattr(p, "ds_shape", p.shape))


def gemm_shapes(m: nn.Module) -> dict[str, tuple[int, int, int]]:
    """``{parameter name: (E, N, K)}`` of each GEMM (N out, K in), whatever the stored layout."""
    out = {}
    for name in _sites(m):
        e, a, b = _shape(getattr(m, name))
        out[name] = (e, b, a) if getattr(m, "is_transposed", False) else (e, a, b)
    return out


def experts_blocker(m: nn.Module, recipe: Recipe) -> str | None:
    """Why this experts module cannot run FP4 GEMMs, or None."""
    transposed = getattr(m, "is_transposed", False)
    if transposed and recipe.weight_block != "16x16":
        return "experts stored transposed ([E, K, N]) need 16x16 weight tiles: 1x16 blocks would run along N"
    if transposed and recipe.act_hadamard:
        return "experts stored transposed with activations.hadamard (RHT along K) are not supported"
    for name, (_, n, k) in gemm_shapes(m).items():
        if k % 16:
            return f"{name}: in dimension {k} is not a multiple of 16 (NVFP4 blocks run along K)"
        if recipe.weight_block == "16x16" and n % 16:
            return f"{name}: out dimension {n} is not a multiple of 16 (16x16 weight tiles)"
    first = _sites(m)[0]
    if first == "gate_up_proj" and recipe.weight_block == "16x16" and (gemm_shapes(m)[first][1] // 2) % 16:
        return ("gate_up_proj: the intermediate size is not a multiple of 16, so a 16x16 tile would hold gate and "
                "up rows (an export could not split them exactly)")
    return None


class FP4Experts(FP4Module):
    """Mixed into an experts instance (``convert`` swaps its class)."""

    kind = "experts"
    #: per GEMM parameter: the max |input| each expert saw in training forwards (float32 ``[E]``; 0 where an expert
    #: got no token), the static activation scales of a W4A4 export
    input_amax: dict[str, torch.Tensor]

    def _init_fp4(self, recipe: Recipe) -> None:
        super()._init_fp4(recipe)
        transposed = getattr(self, "is_transposed", False)
        self.experts_codes = {name: WeightCodes(experts=self.num_experts, transposed=transposed)
                              for name in _sites(self)}
        self.input_amax = {}

    @classmethod
    def convert(cls, module: nn.Module, recipe: Recipe):
        return FP4Module.convert.__func__(_fp4_class(type(module)), module, recipe)

    def fp4_weights(self):
        return [(name, getattr(self, name), codes) for name, codes in self.experts_codes.items()]

    def _gemm(self, name: str, x: torch.Tensor, e: int) -> torch.Tensor:
        param = getattr(self, name)
        transposed = getattr(self, "is_transposed", False)
        weight = param[e].t() if transposed else param[e]
        bias = getattr(self, f"{name}_bias")[e] if getattr(self, "has_bias", False) else None
        out, seen = fp4_forward(self, x, weight, bias, self.experts_codes[name], param=param, index=e,
                                stored_kn=transposed)
        if self.training:
            amax = self.input_amax.get(name)
            if amax is None:
                amax = self.input_amax[name] = torch.zeros(self.num_experts, dtype=torch.float32, device=x.device)
            seen = seen.detach()
            amax[e] = torch.maximum(amax[e], torch.where(torch.isfinite(seen), seen, torch.zeros_like(seen)))
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args, **kwargs) -> torch.Tensor:
        """``[T, H]``: each token's experts' outputs weighted by the router (as transformers' eager experts)."""
        if self.bf16_only:
            return super().forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        first, second = _sites(self)
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for (e,) in hit.tolist():
            if e == self.num_experts:  # the sentinel slot (tokens routed nowhere)
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            h = self._gemm(first, hidden_states[token_idx], e)
            h = self._apply_gate(h) if first == "gate_up_proj" else self.act_fn(h)
            h = self._gemm(second, h, e)
            if getattr(self, "has_post_expert_norm", False):
                h = self.post_expert_norm(h)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The class's own gating when it has one (transformers' decorator adds it), else SiLU-style chunking."""
        own = getattr(super(), "_apply_gate", None)
        if own is not None:
            return own(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


@functools.cache
def _fp4_class(base: type) -> type:
    return type(f"NVFP4{base.__name__}", (FP4Experts, base), {})
