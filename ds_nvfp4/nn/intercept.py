"""FP4 GEMMs inside an experts module's own forward, for experts outside transformers' interface.

Llama 4's text experts multiply all experts at once (``torch.bmm(x [E, T, H], gate_up_proj [E, H, 2I])``), DBRX
slices 2-D parameters per expert (``x.matmul(w1.view(E, I, H)[e].T)``), JetMoE calls ``F.linear(x, weight[e])``:
no common signature, no attribute names to rely on. Their forward runs unchanged under a ``TorchFunctionMode`` that
watches the GEMM functions (``F.linear``, ``matmul`` / ``@``, ``mm``, ``bmm``). When the weight operand of one is a
whole expert matrix (or all experts at once) of an expert weight, seen through views of the parameter's storage,
that GEMM runs in FP4 instead: the expert's matrix quantized along the GEMM's K with that expert's own amax, the
input with its own, exactly as ``NVFP4Linear`` (one expert) or the grouped FP4 Linear (all experts) would.

Anything else that reads an expert weight's storage and is not a view (an unrecognised GEMM, a copy, an
elementwise op) runs as written, in BF16: the first training forward checks that every expert weight reached an FP4
GEMM and that nothing read one otherwise, and says loudly what did not (:attr:`FP4InterceptedExperts.intercept`,
the log), so a family whose forward this cannot follow is never silently BF16.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .experts import ExpertsFP4Base, _fp4_class
from .grouped import grouped_fp4_linear
from .linear import fp4_forward
from .moe import ExpertsSite, ExpertWeight
from .recipe import Recipe

log = logging.getLogger("ds_nvfp4")

_LINEAR = {F.linear}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
           torch.Tensor.bmm}
_RMATMUL = {torch.Tensor.__rmatmul__}


class _Hit:
    """A tensor that is a whole expert matrix (``index``) or all of them (``index`` None) of an expert weight, and
    whether it is seen in its stored layout or transposed."""

    def __init__(self, weight: ExpertWeight, param: torch.Tensor, index: int | None, transposed: bool) -> None:
        self.weight, self.param, self.index, self.transposed = weight, param, index, transposed


class _Intercept(TorchFunctionMode):
    def __init__(self, module: FP4InterceptedExperts) -> None:
        super().__init__()
        self.m = module
        self.storages: dict[int, tuple[ExpertWeight, torch.Tensor]] = {}
        for w in module.site.weights:
            p = module.get_parameter(w.param)
            if p.numel():
                self.storages[p.untyped_storage().data_ptr()] = (w, p)

    def _owner(self, t) -> tuple[ExpertWeight, torch.Tensor] | None:
        if not isinstance(t, torch.Tensor) or not self.storages or t.device.type == "meta":
            return None
        return self.storages.get(t.untyped_storage().data_ptr())

    def _hit(self, t) -> _Hit | None:
        owner = self._owner(t)
        if owner is None:
            return None
        w, p = owner
        rows, cols, per = w.rows, w.cols, w.rows * w.cols
        off = t.storage_offset() - p.storage_offset()
        if t.dim() == 2 and t.numel() == per and off % per == 0:
            if tuple(t.shape) == (rows, cols) and t.stride() == (cols, 1):
                return _Hit(w, p, off // per, False)
            if tuple(t.shape) == (cols, rows) and t.stride() == (1, cols):
                return _Hit(w, p, off // per, True)
        if t.dim() == 3 and t.numel() == per * w.experts and off == 0 and t.shape[0] == w.experts:
            if tuple(t.shape[1:]) == (rows, cols) and t.stride() == (per, cols, 1):
                return _Hit(w, p, None, False)
            if tuple(t.shape[1:]) == (cols, rows) and t.stride() == (per, 1, cols):
                return _Hit(w, p, None, True)
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR and len(args) >= 2 and (hit := self._hit(args[1])) is not None:
            # F.linear(x, W [N, K]): the stored matrix is [N, K] unless W is a transposed view of [K, N]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return self.m._fp4_gemm(hit, args[0], args[1], bias, stored_kn=hit.transposed, op="linear")
        if func in _MATMUL and len(args) >= 2 and (hit := self._hit(args[1])) is not None:
            # x @ B with B [K, N]: the stored matrix is [K, N] unless B is a transposed view of [N, K]
            return self.m._fp4_gemm(hit, args[0], args[1].transpose(-1, -2), None, stored_kn=not hit.transposed,
                                    op=func.__name__)
        if func in _RMATMUL and len(args) >= 2 and (hit := self._hit(args[0])) is not None:
            return self.m._fp4_gemm(hit, args[1], args[0].transpose(-1, -2), None, stored_kn=not hit.transposed,
                                    op="matmul")
        out = func(*args, **kwargs)
        read = [o for o in _tensors(args, kwargs) if self._owner(o) is not None]
        if read and not _is_view(out, {self._owner(o)[1].untyped_storage().data_ptr() for o in read}):
            for o in read:
                self.m._missed(self._owner(o)[0].param, getattr(func, "__name__", str(func)))
        return out


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def _is_view(out, storages: set[int]) -> bool:
    """Whether ``out`` is not a tensor (a size, a dtype) or only views of the expert storages."""
    outs = out if isinstance(out, (list, tuple)) else [out]
    tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    return all(o.untyped_storage().data_ptr() in storages for o in tensors)


class FP4InterceptedExperts(ExpertsFP4Base):
    """Mixed into an experts module outside transformers' interface (see the module docstring)."""

    #: after the first training forward: ``{"fp4": {weight: [ops]}, "bf16": {weight: [ops]}, "unused": [...]}``
    intercept: dict | None

    @classmethod
    def convert(cls, module: nn.Module, recipe: Recipe, site: ExpertsSite) -> nn.Module:
        module.__class__ = _fp4_class(cls, type(module))
        module._init_experts(recipe, site, {w.param: None for w in site.weights})
        for codes in module.experts_codes.values():
            codes.accept_gathered = False  # the GEMM's orientation is seen only here
        module.intercept = None
        module._seen: dict[str, set[str]] = {}
        module._read: dict[str, set[str]] = {}
        return module

    def forward(self, *args, **kwargs):
        if self.bf16_only:
            return super().forward(*args, **kwargs)
        with _Intercept(self):
            out = super().forward(*args, **kwargs)
        if self.intercept is None and self.training:
            self._check_first_forward()
        return out

    def _missed(self, weight: str, op: str) -> None:
        self._read.setdefault(weight, set()).add(op)

    def _fp4_gemm(self, hit: _Hit, x: torch.Tensor, w_nk: torch.Tensor, bias, *, stored_kn: bool, op: str):
        """``x @ w_nk.T (+ bias)`` in FP4: ``w_nk`` ``[N, K]`` (one expert) or ``[E, N, K]`` (all, with ``x``
        ``[E, T, K]``), a view of the parameter; ``stored_kn``: the parameter stores it ``[K, N]``."""
        name = hit.weight.param
        codes = self.experts_codes[name]
        self._seen.setdefault(name, set()).add(op)
        if hit.index is None:  # every expert at once: one grouped FP4 GEMM with equal groups
            e, t = w_nk.shape[0], x.shape[-2]
            lead = x.shape[:-2]
            offsets = torch.arange(1, e + 1, device=x.device) * t
            cached = codes.reuse(hit.param, gathered_ok=False)
            fresh = cached is None
            if fresh:
                codes.quantizations += 1
            out, x_amax, bad, got = grouped_fp4_linear(x.reshape(e * t, x.shape[-1]), w_nk, None, offsets,
                                                       self.recipe, weight_amax=codes.amax(), cached=cached)
            if fresh:
                codes.keep(hit.param, got)
            self._observe(name, x_amax, bad)
            out = out.view(*lead, t, -1)
        else:
            # 16x16 tiles transpose exactly, so a [K, N] matrix is quantized as stored; 1x16 blocks along K of a
            # [K, N] matrix need its transpose (a copy inside the quantizer)
            exact_t = stored_kn and self.recipe.weight_block == "16x16"
            out, seen = fp4_forward(self, x, w_nk, None, codes, param=hit.param, index=hit.index, stored_kn=exact_t)
            self._observe(name, seen, None, index=hit.index)
        return out if bias is None else out + bias

    def _check_first_forward(self) -> None:
        names = [w.param for w in self.site.weights]
        self.intercept = {"fp4": {n: sorted(self._seen.get(n, ())) for n in names if n in self._seen},
                          "bf16": {n: sorted(ops) for n, ops in self._read.items()},
                          "unused": [n for n in names if n not in self._seen and n not in self._read]}
        where = f"ds_nvfp4: experts module {self.site.name} ({type(self).__bases__[1].__name__})"
        if self.intercept["bf16"] or self.intercept["unused"]:
            parts = [f"{n} read by {', '.join(ops)} outside an FP4 GEMM: that part ran BF16"
                     for n, ops in self.intercept["bf16"].items()]
            parts += [f"{n} reached no GEMM ds_nvfp4 recognizes" for n in self.intercept["unused"]]
            log.warning("%s, first forward: %s. Its other expert GEMMs ran FP4.", where, "; ".join(parts))
        else:
            log.info("%s, first forward: every expert GEMM ran FP4 (%s)", where,
                     "; ".join(f"{n}: {', '.join(ops)}" for n, ops in self.intercept["fp4"].items()))
