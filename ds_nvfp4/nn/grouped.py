"""The grouped FP4 Linear of MoE experts: every expert's GEMM of one projection in one call, with autograd.

Shapes: ``x [M, K]`` holds the tokens routed to each expert, sorted by expert (expert ``g``'s rows end at
``offsets[g]``; ``row_group [M]`` names each row's expert), ``weight [E, N, K]`` the experts' weights in the GEMM's
layout (any strides: a transposed view of a ``[E, K, N]`` parameter is fine), ``bias [E, N]`` or None.

Numerics are those of :func:`ds_nvfp4.nn.ops.linear_fwd` applied to each expert alone: the weight of each expert is
quantized with its own per-tensor amax (or the ZeRO-agreed one), the tokens of each expert with theirs (MoE
quantizes "the input of expert g" as one tensor), both in one pass (``format/grouped.py``); the GEMMs run grouped
on the emulated backend (``kernels/emulated.py``), one per expert elsewhere. Backward ``bf16``: Dgrad against the
dequantized codes the forward multiplied, Wgrad ``dY^T X`` per expert, both grouped; backward ``nvfp4`` (the paper
recipe): each expert's backward is exactly ``ops.linear_bwd`` (one host read of the offsets, then one call per
expert).
"""

from __future__ import annotations

import torch

from ..format import BLOCK_SIZE, NVFP4Storage, _kernels, hadamard, inverse_hadamard, quantize
from ..format.grouped import group_rows
from ..kernels import get_backend
from ..kernels.base import GroupedOperand
from .ops import _linear_bwd, _no_autocast
from .recipe import Recipe

#: ``(data [E, N, K/2] uint8, scale e4m3 [E, N or N/16, K/16], amax [E] float32)``: one experts weight's codes
GroupedCodes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def quantize_experts(weight: torch.Tensor, recipe: Recipe, amax: torch.Tensor | None = None) -> GroupedCodes:
    """Every expert of ``weight [E, N, K]`` quantized with the recipe's weight block, each with its own amax (or
    ``amax [E]``), in one call (4/6 scaling: one call per expert): bit for bit ``quantize(weight[e], amax=amax[e])``."""
    return _quantize_experts(weight, recipe, amax, None)[0]


def _quantize_experts(weight: torch.Tensor, recipe: Recipe, amax: torch.Tensor | None,
                      values_dtype: torch.dtype | None) -> tuple[GroupedCodes, torch.Tensor | None]:
    """:func:`quantize_experts` and, with ``values_dtype``, the GEMM operand values ``[E*N, K]`` the same pass
    computed (the forward then skips decoding them again from the codes; None for 4/6 scaling)."""
    e, n, k = weight.shape
    w = hadamard(weight) if recipe.act_hadamard else weight
    if recipe.act_hadamard:
        amax = None  # an RHT layer quantizes H(W) with its own amax
    if not recipe.weight.standard:
        parts = [quantize(w[i], block=recipe.weight_block, amax=None if amax is None else amax[i].reshape(()),
                          scaling=recipe.weight) for i in range(e)]
        return (torch.stack([q.data for q in parts]), torch.stack([q.scale for q in parts]),
                torch.stack([q.amax for q in parts])), None
    rows = torch.arange(e, device=w.device).repeat_interleave(n)
    from ..format.grouped import quantize_grouped

    values, used, data, scale = quantize_grouped(w.reshape(e * n, k), rows, e, block=recipe.weight_block, amax=amax,
                                                 dtype=values_dtype or torch.bfloat16, keep_codes=True)
    return (data.view(e, n, k // 2), scale.view(e, -1, k // BLOCK_SIZE), used), \
        (values if values_dtype is not None else None)


def _weight_operand(backend, codes: GroupedCodes, recipe: Recipe, values: torch.Tensor | None = None
                    ) -> GroupedOperand:
    """The experts' weight as the backend's grouped operand; ``values``: the operand values ``[E*N, K]`` when the
    quantizer just computed them (else decoded from the codes here, as for codes cached or gathered)."""
    data, scale, amax = codes
    e, n, half = data.shape
    flat_data, flat_scale = data.reshape(e * n, half), scale.reshape(-1, scale.shape[-1])
    if values is None and hasattr(backend, "operand_dtype"):
        values = _kernels.block_values(flat_data, flat_scale, recipe.weight_block, backend.operand_dtype(data.device))
    return GroupedOperand(amax, flat_scale, flat_data, values, recipe.weight_block)


def dequantize_experts(codes: GroupedCodes, recipe: Recipe, dtype: torch.dtype) -> torch.Tensor:
    """``[E, N, K]`` ``dtype``: each expert's codes decoded with its amax, bit for bit ``NVFP4Storage.dequantize``
    per expert, in one pass (the decode factor ``s_b * amax_e / (6 bound)`` per block row)."""
    data, scale, amax = codes
    e, n, half = data.shape
    numerator = 6.0 * (float(recipe.weight.e4m3_bound) if not recipe.weight.standard else 448.0)
    rows = scale.shape[1]  # N (1x16) or N/16 (16x16)
    amax_rows = amax.float().repeat_interleave(rows).unsqueeze(1)
    out = _kernels.decode_bounded(data.reshape(e * n, half), scale.reshape(e * rows, -1), amax_rows,
                                  recipe.weight_block, dtype, numerator / 6.0)
    return out.view(e, n, 2 * half)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, offsets, row_group, recipe: Recipe, weight_amax, cached, out_dtype):
        with _no_autocast(x):
            backend = get_backend(recipe.kernel)
            # the emulated grouped GEMM multiplies operand values: the quantizer's own, when it runs here
            want = backend.operand_dtype(x.device) if backend.grouped and recipe.forward_gemm != "bf16" \
                and hasattr(backend, "operand_dtype") else None
            codes, w_values = (cached, None) if cached is not None else \
                _quantize_experts(weight.detach(), recipe, weight_amax, want)
            e = weight.shape[0]
            xin = hadamard(x) if recipe.act_hadamard else x
            if recipe.forward_gemm == "bf16":  # the schedule's late switch: BF16 Fprop, the FP4 backward keeps codes
                out = _grouped_bf16(x, weight.transpose(1, 2), offsets)
                if bias is not None:
                    out = out.float() + bias[row_group].float()
                out = out.to(out_dtype)
                x_amax = _group_absmax(x, row_group, e)
                bad = ~torch.isfinite(out).all()
            elif backend.grouped:
                xo = backend.quantize_grouped(xin.contiguous(), row_group, e, block="1x16")
                out, bad = backend.grouped_linear(xo, _weight_operand(backend, codes, recipe, w_values), offsets, bias,
                                                  out_dtype)
                x_amax = _group_absmax(x, row_group, e) if recipe.act_hadamard else xo.amax
            else:  # a backend without a grouped GEMM: one FP4 GEMM per expert, one host read of the offsets
                out, x_amax, bad = _per_expert_forward(backend, xin, codes, bias, offsets, recipe, out_dtype)
                if recipe.act_hadamard:
                    x_amax = _group_absmax(x, row_group, e)
        ctx.save_for_backward(x, offsets, row_group, *codes)
        ctx.recipe, ctx.has_bias, ctx.w_dtype, ctx.x_dtype = recipe, bias is not None, weight.dtype, x.dtype
        ctx.mark_non_differentiable(x_amax, bad, *codes)
        return out, x_amax, bad, *(c.detach() for c in codes)

    @staticmethod
    def backward(ctx, grad, *_unused):
        x, offsets, row_group, data, scale, amax = ctx.saved_tensors
        r: Recipe = ctx.recipe
        e, n, half = data.shape
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and \
            ctx.needs_input_grad[2]
        grad = grad.contiguous()
        dx = dw = db = None
        with _no_autocast(grad):
            if r.backward_gemm == "bf16":
                if need_dx:  # Dgrad against the very weights the forward multiplied
                    w_used = dequantize_experts((data, scale, amax), r, torch.bfloat16)
                    if r.act_hadamard:
                        w_used = inverse_hadamard(w_used)
                    dx = _grouped_bf16(grad, w_used, offsets).to(ctx.x_dtype)
                if need_dw:
                    dw = _grouped_wgrad(grad, x, offsets, e).to(ctx.w_dtype)
            else:
                dx_parts, dw_parts = [], []
                start = 0
                for g, end in enumerate(offsets.tolist()):
                    if end > start:
                        pdx, pdw, _ = _linear_bwd(grad[start:end], x[start:end], data[g], scale[g], amax[g],
                                                  r.encode(), ctx.x_dtype, ctx.w_dtype, need_dx, need_dw, False)
                        dx_parts.append(pdx)
                        dw_parts.append(pdw if need_dw else None)
                    else:
                        dw_parts.append(x.new_zeros(n, 2 * half, dtype=ctx.w_dtype) if need_dw else None)
                    start = end
                if need_dx:
                    dx = torch.cat(dx_parts) if dx_parts else x.new_zeros(x.shape, dtype=ctx.x_dtype)
                    if dx.shape[0] < x.shape[0]:  # rows past the last expert's offset (routed nowhere)
                        dx = torch.cat([dx, dx.new_zeros(x.shape[0] - dx.shape[0], dx.shape[1])])
                if need_dw:
                    dw = torch.stack([p for p in dw_parts])
            if need_db:
                db = torch.zeros(e, n, dtype=torch.float32, device=grad.device).index_add_(
                    0, row_group, grad.float()).to(ctx.w_dtype)
        return dx, dw, db, None, None, None, None, None, None


def _group_absmax(x: torch.Tensor, row_group: torch.Tensor, groups: int) -> torch.Tensor:
    """float32 ``[groups]`` max |x| over each group's rows (NaN when a row held NaN: flags a non-finite step)."""
    from ..format.grouped import group_amax

    return group_amax(x.detach().float().abs(), row_group, groups)


def _per_expert_forward(backend, x, codes: GroupedCodes, bias, offsets, recipe: Recipe, out_dtype):
    data, scale, amax = codes
    e, n, half = data.shape
    out = x.new_zeros(x.shape[0], n, dtype=out_dtype)
    x_amax = torch.zeros(e, dtype=torch.float32, device=x.device)
    bad = torch.zeros((), dtype=torch.bool, device=x.device)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            wq = NVFP4Storage(data[g], scale[g], amax[g], torch.Size((n, 2 * half)), recipe.weight_block,
                              float(recipe.weight.e4m3_bound))
            xo = backend.quantize(x[start:end], block="1x16")
            out[start:end], b = backend.linear(xo, backend.operand(wq), None if bias is None else bias[g], out_dtype)
            x_amax[g], bad = xo.amax, bad | b
        start = end
    return out, x_amax, bad


def _grouped_bf16(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b[g] [K, N]`` per group as BF16 GEMMs (FP32 accumulation, BF16 result), written in place."""
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    out = torch.empty(a.shape[0], b.shape[2], dtype=torch.bfloat16, device=a.device)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(a[start:end], b[g], out=out[start:end])
        start = end
    if start < a.shape[0]:
        out[start:] = 0
    return out


def _grouped_wgrad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, groups: int) -> torch.Tensor:
    """``[E, N, K]``: ``grad_g^T @ x_g`` per group as BF16 GEMMs (0 for an expert without tokens)."""
    grad, x = grad.to(torch.bfloat16), x.to(torch.bfloat16)
    out = torch.empty(groups, grad.shape[1], x.shape[1], dtype=torch.bfloat16, device=grad.device)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(grad[start:end].t(), x[start:end], out=out[g])
        else:
            out[g] = 0
        start = end
    return out


def grouped_fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, offsets: torch.Tensor,
                       recipe: Recipe, *, row_group: torch.Tensor | None = None,
                       weight_amax: torch.Tensor | None = None, cached: GroupedCodes | None = None,
                       out_dtype: torch.dtype | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, GroupedCodes]:
    """``(out [M, N], max|x| per expert [E] float32, output-non-finite bool 0-dim, the weight's codes)``.

    ``cached``: the experts' codes from an earlier forward of the step or a gather (then not quantized again);
    ``weight_amax [E]``: the ZeRO-agreed per-expert amax. See the module docstring for shapes."""
    if row_group is None:
        row_group = group_rows(offsets, x.shape[0])
    dev = x.device.type
    out_dtype = out_dtype or (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype)
    out, x_amax, bad, *codes = _GroupedLinear.apply(x, weight, bias, offsets, row_group, recipe, weight_amax,
                                                    cached, out_dtype)
    return out, x_amax.detach(), bad.detach(), tuple(codes)
