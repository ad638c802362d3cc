"""The FP4 Linear as two ``torch.library`` custom ops with an autograd formula.

Being custom ops, TorchDynamo and Inductor see them as opaque nodes (``ds_nvfp4::linear_fwd`` /
``ds_nvfp4::linear_bwd``): a compiled model keeps its FP4 GEMMs and cannot fuse the quantization away, which is
why other stacks advise turning fusion off. Shapes: ``x`` ``[M, K]`` (M any size), ``weight`` ``[N, K]``.

Forward (always FP4): x quantized 1x16 with its own amax; weight quantized with the recipe's block (and the
ZeRO-agreed amax when one is attached to the parameter); optional RHT of both along K.
Backward, ``bf16``: Dgrad ``dY @ W'`` and Wgrad ``dY^T @ X`` as BF16 GEMMs (FP32 accumulation, BF16 result), where
``W'`` is the very weight the forward multiplied (its saved NVFP4 codes, dequantized; rotated back if RHT).
Backward, ``nvfp4``: Dgrad with ``dY`` 1x16 (stochastic rounding) and the transposed 16x16 weight codes (no
re-quantization); Wgrad with ``dY^T`` and ``X^T`` quantized along the token dim (zero-padded to 16), RHT on both,
``dY^T`` stochastically rounded.
"""

from __future__ import annotations

import torch

from ..format import NVFP4Storage, hadamard, inverse_hadamard
from ..kernels import Operand, get_backend
from .recipe import Recipe


def _pad_rows(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Zero rows appended so the row count is a multiple of 16 (zeros add nothing to a GEMM)."""
    extra = (-t.shape[0]) % multiple
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def _bf16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as a BF16 GEMM (BF16 operands, FP32 accumulation inside the library, BF16 result)."""
    return a.to(torch.bfloat16) @ b.to(torch.bfloat16)


def _weight_operand(backend, weight: torch.Tensor, weight_amax: torch.Tensor | None, r: Recipe) -> Operand:
    """The weight's GEMM operand, with its NVFP4 codes (saved for the backward)."""
    w = hadamard(weight) if r.act_hadamard else weight
    amax = None if (weight_amax is None or r.act_hadamard) else weight_amax.float().reshape(())
    return backend.quantize(w, block=r.weight_block, amax=amax, keep_codes=True, scaling=r.weight)


@torch.library.custom_op("ds_nvfp4::linear_fwd", mutates_args=())
def linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_amax: torch.Tensor | None,
               recipe: str, out_dtype: torch.dtype, w_data: torch.Tensor | None = None,
               w_scale: torch.Tensor | None = None, w_amax: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out [M, N], w_data, w_scale, w_amax, x_amax, out_nonfinite)``: the weight's NVFP4 storage (saved
    for the backward), max|x| (float32 0-dim, NaN if x held NaN/Inf: the quantizer computed it anyway) and whether
    any output is NaN/Inf (bool 0-dim): what NVFP4Linear tracks without extra passes.

    ``w_data``/``w_scale``/``w_amax``: the weight's codes from an earlier forward of the same optimizer step (the
    weight cache of NVFP4Linear); the weight is then not quantized again and the three storage outputs are empty
    (the backward saves the given ones: custom-op outputs may not alias inputs)."""
    with _no_autocast(x):
        return _linear_fwd(x, weight, bias, weight_amax, recipe, out_dtype, w_data, w_scale, w_amax)


def _no_autocast(t: torch.Tensor):
    """The FP4 path defines its own precisions: an outer autocast must not turn its FP32 GEMMs into BF16."""
    return torch.autocast(t.device.type, enabled=False)


def _linear_fwd(x, weight, bias, weight_amax, recipe: str, out_dtype: torch.dtype, w_data=None, w_scale=None,
                w_amax=None):
    r = Recipe.decode(recipe)
    backend = get_backend(r.kernel)
    if w_data is not None:
        wq = NVFP4Storage(w_data, w_scale, w_amax, torch.Size(weight.shape), r.weight_block, r.weight.e4m3_bound)
        wo = backend.operand(wq)
        stored = (w_data.new_empty(0), w_scale.new_empty(0), w_amax.new_empty(0))
    else:
        wo = _weight_operand(backend, weight, weight_amax, r)
        wq = wo.tensor
        stored = (wq.data, wq.scale, wq.amax.clone())
    if r.forward_gemm == "bf16":  # the schedule's late switch: BF16 Fprop, FP4 backward from the codes above
        out = _bf16_gemm(x, weight.t())
        if bias is not None:
            out = out + bias.to(out.dtype)
        out = out.to(out_dtype)
        return out, *stored, x.detach().abs().amax().float(), ~torch.isfinite(out).all()
    xo = backend.quantize(hadamard(x) if r.act_hadamard else x, block="1x16")
    out, bad = backend.linear(xo, wo, bias, out_dtype)
    x_amax = x.detach().abs().amax().float() if r.act_hadamard else xo.amax.clone()
    return out, *stored, x_amax, bad


@linear_fwd.register_fake
def _(x, weight, bias, weight_amax, recipe, out_dtype, w_data=None, w_scale=None, w_amax=None):
    r = Recipe.decode(recipe)
    n, k = weight.shape
    if w_data is not None:
        return (x.new_empty(x.shape[0], n, dtype=out_dtype), w_data.new_empty(0), w_scale.new_empty(0),
                w_amax.new_empty(0), x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.bool))
    s_rows = n // 16 if r.weight_block == "16x16" else n
    return (x.new_empty(x.shape[0], n, dtype=out_dtype), weight.new_empty(n, k // 2, dtype=torch.uint8),
            weight.new_empty(s_rows, k // 16, dtype=torch.float8_e4m3fn), weight.new_empty((), dtype=torch.float32),
            x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.bool))


@torch.library.custom_op("ds_nvfp4::linear_bwd", mutates_args=())
def linear_bwd(grad: torch.Tensor, x: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor, w_amax: torch.Tensor,
               recipe: str, x_dtype: torch.dtype, w_dtype: torch.dtype, need_dx: bool, need_dw: bool,
               need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dx [M, K], dw [N, K], db [N])``; an unneeded gradient is an empty tensor."""
    with _no_autocast(grad):
        return _linear_bwd(grad, x, w_data, w_scale, w_amax, recipe, x_dtype, w_dtype, need_dx, need_dw, need_db)


def _linear_bwd(grad, x, w_data, w_scale, w_amax, recipe: str, x_dtype, w_dtype, need_dx, need_dw, need_db):
    r = Recipe.decode(recipe)
    n, k = w_data.shape[0], w_data.shape[1] * 2
    wq = NVFP4Storage(w_data, w_scale, w_amax, torch.Size((n, k)), r.weight_block, r.weight.e4m3_bound)
    backend = get_backend(r.kernel)
    # an unneeded gradient is a fresh empty tensor: custom-op outputs must not alias each other
    dx, dw, db = grad.new_empty(0), grad.new_empty(0), grad.new_empty(0)
    if r.backward_gemm == "bf16":
        if need_dx:
            w_used = wq.dequantize(torch.bfloat16)
            if r.act_hadamard:
                w_used = inverse_hadamard(w_used)
            dx = _bf16_gemm(grad, w_used).to(x_dtype)
        if need_dw:
            dw = _bf16_gemm(grad.t(), x).to(w_dtype)
    else:
        rounding = "stochastic" if r.stochastic_rounding else "nearest"
        if need_dx:
            gq = backend.quantize(grad, block="1x16", rounding=rounding)
            if r.act_hadamard:
                dx = inverse_hadamard(backend.mm(gq, backend.operand(wq).t(), torch.float32)).to(x_dtype)
            else:  # the GEMM's epilogue casts to x's dtype (the same single rounding as float32 then .to)
                dx = backend.mm(gq, backend.operand(wq).t(), x_dtype)
        if need_dw:
            gt, xt = _pad_rows(grad).t(), _pad_rows(x).t()  # [N, Mp], [K, Mp]: quantized along tokens
            if r.backward_hadamard:
                gt, xt = hadamard(gt), hadamard(xt)
            dw = backend.mm(backend.quantize(gt.contiguous(), rounding=rounding),
                            backend.quantize(xt.contiguous()), w_dtype)
    if need_db:
        db = grad.sum(0, dtype=torch.float32).to(w_dtype)  # the same float32 sums, without a float copy of grad
    return dx, dw, db


@linear_bwd.register_fake
def _(grad, x, w_data, w_scale, w_amax, recipe, x_dtype, w_dtype, need_dx, need_dw, need_db):
    n, k = w_data.shape[0], w_data.shape[1] * 2
    e = grad.new_empty(0)
    return (x.new_empty(x.shape, dtype=x_dtype) if need_dx else e,
            grad.new_empty(n, k, dtype=w_dtype) if need_dw else e,
            grad.new_empty(n, dtype=w_dtype) if need_db else e)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _weight_amax, recipe, _out_dtype, cached_data, cached_scale, cached_amax = inputs
    _, w_data, w_scale, w_amax, _x_amax, _bad = output
    if cached_data is not None:
        w_data, w_scale, w_amax = cached_data, cached_scale, cached_amax
    ctx.save_for_backward(x, w_data, w_scale, w_amax)
    ctx.recipe = recipe
    ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
    ctx.has_bias = bias is not None


def _backward(ctx, grad_out, *_unused):
    x, w_data, w_scale, w_amax = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    dx, dw, db = linear_bwd(grad_out.contiguous(), x, w_data, w_scale, w_amax, ctx.recipe, ctx.x_dtype,
                            ctx.w_dtype, need_dx, need_dw, need_db)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None, None, None, None, None, None,
            None)


linear_fwd.register_autograd(_backward, setup_context=_setup_context)


def fp4_linear_tracked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe,
                       weight_amax: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                       cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`fp4_linear` plus ``(max|x| float32 0-dim, output-non-finite bool 0-dim, weight codes)``, computed on
    the way; ``cached``: the weight's ``(data, scale, amax)`` from an earlier forward (returned as they are)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out, w_data, w_scale, w_amax, x_amax, bad = linear_fwd(x2, weight, bias, weight_amax, recipe.encode(),
                                                           out_dtype or x.dtype, *(cached or (None, None, None)))
    # statistics, not part of the function: detached, or a running max over them would chain every step's graph
    # (and its saved activations) into the next one
    return (out.reshape(*lead, weight.shape[0]), x_amax.detach(), bad.detach(),
            cached or (w_data.detach(), w_scale.detach(), w_amax.detach()))


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe,
               weight_amax: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Functional FP4 Linear over leading dims: ``x`` ``[..., K]`` -> ``[..., N]``."""
    return fp4_linear_tracked(x, weight, bias, recipe, weight_amax, out_dtype)[0]
