"""FP4 GEMMs of MoE experts modules, found by nn/moe.py: what both kinds share, and the interface kind.

Two classes are mixed into an experts module in place (``convert`` swaps its class; parameters, state_dict keys,
hooks and the ZeRO-3 partitioning stay as they are):

* :class:`FP4Experts` for modules that follow transformers' experts interface (``execution == "interface"``): the
  forward of the interface's ``grouped_mm`` implementation (tokens sorted by expert, one GEMM per projection) with
  every expert GEMM in FP4 (nn/grouped.py), honouring the interface's declared layout: ``has_gate``,
  ``is_concatenated`` (through the class's own ``_apply_gate``, e.g. GPT-OSS's interleaved, clamped SwiGLU),
  ``is_transposed`` (weights stored ``[E, K, N]``), ``has_bias``, ``has_post_expert_norm``. It is called as
  ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` (names free, positions fixed).
* :class:`~ds_nvfp4.nn.intercept.FP4InterceptedExperts` for every other module with expert weights.

Why a class swap and not an ``"nvfp4"`` entry of transformers' experts registry: the registry is chosen model-wide
(``config._experts_implementation``), while ``precision.modules`` decides per module (first and last blocks BF16),
and a later ``model.set_experts_implementation(...)`` would switch FP4 off without a word. With every GEMM BF16 (a
schedule phase) the class's own forward runs, i.e. the configured implementation.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .grouped import grouped_fp4_linear
from .module import FP4Module
from .moe import ExpertsSite, ExpertWeight
from .recipe import Recipe
from .weights import WeightCodes


def gemm_shape(w: ExpertWeight, transposed: bool) -> tuple[int, int, int]:
    """``(E, N, K)`` of an expert weight's GEMM from its stored ``(E, rows, cols)``."""
    return (w.experts, w.cols, w.rows) if transposed else w.shape


def experts_blocker(site: ExpertsSite, recipe: Recipe, transposed: dict[str, bool | None]) -> str | None:
    """Why this experts module cannot run FP4 GEMMs, or None. ``transposed``: per weight, whether it is stored
    ``[E, K, N]`` (None: known only at the GEMM, as for intercepted modules)."""
    for w in site.weights:
        t = transposed.get(w.param)
        dims = {"K": w.rows if t else w.cols, "N": w.cols if t else w.rows} if t is not None else \
            {"rows": w.rows, "cols": w.cols}
        if t is None and any(v % 16 for v in dims.values()):
            return f"{w.param}: per-expert {w.rows}x{w.cols} is not a multiple of 16 in both dimensions"
        if t is not None and dims["K"] % 16:
            return f"{w.param}: in dimension {dims['K']} is not a multiple of 16 (NVFP4 blocks run along K)"
        if t is not None and recipe.weight_block == "16x16" and dims["N"] % 16:
            return f"{w.param}: out dimension {dims['N']} is not a multiple of 16 (16x16 weight tiles)"
        if recipe.act_hadamard and t is not False:
            return f"{w.param}: activations.hadamard (RHT along K) needs experts stored [E, N, K]"
    if site.execution == "interface" and site.weights and recipe.weight_block == "16x16":
        first = site.weights[0]
        n = gemm_shape(first, bool(transposed.get(first.param)))[1]
        if n // 2 % 16:
            return (f"{first.param}: the intermediate size {n // 2} is not a multiple of 16, so a 16x16 tile would "
                    "hold gate and up rows (an export could not split them exactly)")
    return None


class ExpertsFP4Base(FP4Module):
    """What every FP4 experts module holds: one :class:`WeightCodes` per expert weight (``experts_codes``, keyed by
    the weight's dotted name), the per-expert input amax of training forwards (the static activation scales of a
    W4A4 export) and the site found by nn/moe.py."""

    kind = "experts"
    site: ExpertsSite
    experts_codes: dict[str, WeightCodes]
    #: per GEMM weight: the max |input| each expert saw in training forwards (float32 ``[E]``; 0 where an expert
    #: got no token)
    input_amax: dict[str, torch.Tensor]

    def _init_experts(self, recipe: Recipe, site: ExpertsSite, transposed: dict[str, bool | None]) -> None:
        super()._init_fp4(recipe)
        self.site = site
        self.experts_codes = {w.param: WeightCodes(experts=w.experts, transposed=bool(transposed.get(w.param)),
                                                   stored_shape=w.shape if w.stacked else None)
                              for w in site.weights}
        self.input_amax = {}

    def fp4_weights(self):
        return [(name, self.get_parameter(name), codes) for name, codes in self.experts_codes.items()]

    def _observe(self, name: str, x_amax: torch.Tensor, bad: torch.Tensor | None, index: int | None = None) -> None:
        """Training forwards: the per-expert running input amax (``x_amax`` ``[E]``, or a 0-dim for expert
        ``index``) and the non-finite flag (``bad`` None: the GEMM flagged it already)."""
        if not self.training:
            return
        seen = x_amax.detach()
        if bad is not None:
            self._flag(seen.amax() if seen.dim() else seen, bad)
        finite = torch.where(torch.isfinite(seen), seen, torch.zeros_like(seen))
        amax = self.input_amax.get(name)
        if amax is None:
            amax = self.input_amax[name] = torch.zeros(self.site.experts, dtype=torch.float32, device=seen.device)
        if index is None:
            amax.copy_(torch.maximum(amax, finite))
        else:
            amax[index] = torch.maximum(amax[index], finite)


class FP4Experts(ExpertsFP4Base):
    """Mixed into an experts module that follows transformers' experts interface (see the module docstring)."""

    @classmethod
    def convert(cls, module: nn.Module, recipe: Recipe, site: ExpertsSite) -> nn.Module:
        module.__class__ = _fp4_class(cls, type(module))
        transposed = {w.param: bool(module.is_transposed) for w in site.weights}
        module._init_experts(recipe, site, transposed)
        return module

    def _grouped(self, name: str, x: torch.Tensor, offsets: torch.Tensor, row_group: torch.Tensor) -> torch.Tensor:
        param = self.get_parameter(name)
        weight = param.transpose(1, 2) if self.is_transposed else param  # [E, N, K] (a view)
        bias = getattr(self, f"{name}_bias") if self.has_bias else None
        codes = self.experts_codes[name]
        cached = codes.reuse(param, gathered_ok=not self.recipe.act_hadamard)
        fresh = cached is None
        if fresh:
            codes.quantizations += 1
        if self.stats.capture:
            self.stats.observe_forward(x, weight.reshape(-1, weight.shape[-1]), self.recipe, None)
        out, x_amax, bad, got = grouped_fp4_linear(x, weight, bias, offsets, self.recipe, row_group=row_group,
                                                   weight_amax=codes.amax(), cached=cached)
        if fresh:
            codes.keep(param, got)
        self._observe(name, x_amax, bad)
        if self.stats.capture and out.requires_grad:
            out.register_hook(self.stats.observe_grad)
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args, **kwargs) -> torch.Tensor:
        """``[T, H]``: each token's experts' outputs weighted by the router (transformers' grouped_mm forward)."""
        if self.bf16_only:
            return super().forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        e = self.site.experts
        tokens, k = top_k_index.shape[0], top_k_index.shape[-1]
        ids = top_k_index.reshape(-1)
        ids_sorted, perm = torch.sort(ids, stable=True)
        x = hidden_states[perm // k]
        # tokens per expert without a host sync; ids == E (expert-parallel sentinels) fall past offsets[-1]
        counts = torch.zeros(e + 1, dtype=torch.int64, device=ids.device).index_add_(
            0, ids_sorted.clamp(max=e), torch.ones_like(ids_sorted))[:e]
        offsets = counts.cumsum(0)
        row_group = ids_sorted.clamp(max=e - 1)
        first = "gate_up_proj" if self.has_gate else "up_proj"
        h = self._grouped(first, x, offsets, row_group)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = self._grouped("down_proj", h, offsets, row_group)
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        weights = top_k_weights.reshape(-1)[perm]
        if getattr(self, "_is_expert_parallel", False):
            weights = weights.masked_fill(ids_sorted >= e, 0.0)
            h = h.masked_fill((ids_sorted >= e).unsqueeze(1), 0.0)
        weighted = h * weights.unsqueeze(-1).to(h.dtype)
        out = torch.empty_like(weighted).index_copy_(0, perm, weighted)  # back to (token, slot) order
        # the FP32 sum over the k slots of transformers' grouped_mm implementation
        return out.view(tokens, k, -1).float().sum(dim=1).to(hidden_states.dtype)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The class's own gating (transformers' decorator adds one; GPT-OSS defines its own), else SwiGLU halves."""
        own = getattr(super(), "_apply_gate", None)
        if own is not None:
            return own(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


@functools.cache
def _fp4_class(mixin: type, base: type) -> type:
    return type(f"NVFP4{base.__name__}", (mixin, base), {})

