"""`WeightCodes`: where an NVFP4 layer's weight codes come from in one forward (the layer <-> storage contract).

The layer owns one (``layer.weight_codes``); the engine's weight-cache feature and the packed ZeRO-3 storage talk to
it through its methods, never through attributes hung on Parameters. ``Codes`` are the three fields of the weight's
:class:`~ds_nvfp4.format.NVFP4Storage` in the GEMM's ``[N, K]`` layout: ``(data uint8 [N, K/2], scale
float8_e4m3fn, amax float32 0-dim)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fused import share_amax

Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _token(weight: torch.Tensor) -> tuple:
    """What identifies the weight's current values: storage, in-place version counter, shape, dtype. DeepSpeed writes
    through flat buffers bypass the version counter: the engine invalidates cached codes after each optimizer step."""
    return weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype


class FusedGroup:
    """Layers whose weights share one per-tensor amax (``precision.modules.fuse``) computed from their full weights
    (ZeRO-0/1/2 or no DeepSpeed; under ZeRO-3 the packed storage agrees on the group's amax instead and sets it as
    each member's :attr:`WeightCodes.agreed_amax`)."""

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        self.layers = tuple(layers)

    def amax(self) -> torch.Tensor:
        """float32 0-dim: the max of |W| over every member."""
        weights = [m.weight for m in self.layers]
        if any(w.numel() != m.in_features * m.out_features for w, m in zip(weights, self.layers)):
            raise RuntimeError("a fused group member's weight is partitioned (ZeRO-3 without packed storage): the "
                               "group's amax cannot be read in this forward; ds_nvfp4.initialize unfuses such groups, "
                               "convert_model alone cannot know")
        own = torch.stack([w.detach().abs().amax().float() for w in weights])
        return share_amax(own, [range(len(weights))])[0]


class WeightCodes:
    """How one NVFP4 weight gets its NVFP4 codes for a forward GEMM.

    A forward first asks :meth:`reuse`, which answers, in this order:

    1. the codes the packed ZeRO-3 storage gathered with the weight (``communication.all_gather: "nvfp4"``,
       :meth:`offer_gathered`), while the gathered weight is unchanged (its storage and version counter): they are
       exactly what quantizing it with its agreed amax gives (the exactness invariant of docs/zero.md). Not for RHT
       layers (they quantize H(W)). An edit through ``param.data`` bypasses the version counter and is not seen;
    2. the codes of an earlier forward of the same optimizer step when :attr:`cache` is on (ZeRO-0/1/2: the weight
       changes only at optimizer steps; gradient accumulation, activation-checkpointing recomputation and
       evaluation forwards reuse them). The engine's weight-cache feature turns it on and calls :meth:`invalidate`
       after every optimizer step and checkpoint load;
    3. nothing: the module quantizes the weight with :meth:`amax` and hands the codes to :meth:`keep`.

    ``experts``: the weight is ``[E, N, K]`` (one matrix per expert, each with its own amax: :attr:`agreed_amax` is
    ``[E]``) and every call names the expert ``index``. ``transposed``: the weight is stored ``[K, N]`` (a Conv1D);
    codes are always kept in the GEMM's ``[N, K]`` layout, so gathered codes of the stored layout are transposed
    once when offered (exact for 16x16 tiles).
    """

    def __init__(self, experts: int | None = None, transposed: bool = False,
                 stored_shape: tuple[int, int, int] | None = None, accept_gathered: bool = True) -> None:
        self.experts = experts
        self.transposed = transposed
        #: ``(E, rows, cols)`` for experts stacked in a 2-D parameter ``[E*rows, cols]`` (DBRX): the packed ZeRO-3
        #: storage quantizes it per expert with this shape; None: the parameter's own shape
        self.stored_shape = stored_shape
        #: whether codes gathered by the packed storage (in the stored layout) are the GEMM's: False where the GEMM's
        #: orientation is only seen in the forward (intercepted experts), which then re-quantizes the gathered weight
        #: with the agreed amax (the same codes: quantizing NVFP4 values with their own amax is exact)
        self.accept_gathered = accept_gathered
        #: reuse this step's codes (set by the engine; off for a bare ``convert_model``)
        self.cache = False
        #: float32 per-tensor amax (``[E]`` per expert) the packed ZeRO-3 storage agreed across ranks, or None
        self.agreed_amax: torch.Tensor | None = None
        #: the fused group whose shared amax this weight takes (None: its own)
        self.group: FusedGroup | None = None
        #: how many times the module quantized this weight (every forward without reuse; counted before the GEMM:
        #: an activation-checkpointing recomputation may stop right after it)
        self.quantizations = 0
        self._gathered: tuple[tuple, Codes] | None = None
        self._cached: dict[int | None, tuple[tuple, Codes]] = {}

    def reuse(self, weight: torch.Tensor, *, index: int | None = None, gathered_ok: bool = True) -> Codes | None:
        """Codes valid for ``weight``'s current values (expert ``index`` of a 3-D weight), or None."""
        token = _token(weight)
        if gathered_ok and self._gathered is not None and self._gathered[0] == token:
            codes = self._gathered[1]
            return codes if index is None else tuple(c[index] for c in codes)
        hit = self._cached.get(index) if self.cache else None
        return hit[1] if hit is not None and hit[0] == token else None

    def amax(self, index: int | None = None) -> torch.Tensor | None:
        """The per-tensor amax to quantize with (float32 0-dim): the storage's agreed one, the fused group's, or
        None (the weight's own max |W|)."""
        if self.agreed_amax is not None:
            return self.agreed_amax if index is None else self.agreed_amax[index]
        return self.group.amax() if self.group is not None else None

    def keep(self, weight: torch.Tensor, codes: Codes, index: int | None = None) -> None:
        """The module quantized ``weight`` (expert ``index``) into ``codes`` (kept for reuse when :attr:`cache`)."""
        if self.cache:
            self._cached[index] = (_token(weight), tuple(c.detach() for c in codes))
        else:
            self._cached.clear()

    def invalidate(self) -> None:
        """The weight changed where its version counter cannot see it (an optimizer step, a checkpoint load)."""
        self._cached.clear()

    def offer_gathered(self, weight: torch.Tensor, codes: Codes) -> None:
        """The storage gathered ``weight`` together with its codes in the weight's stored layout (``[E, ...]`` per
        expert; ``[K, N]`` for a transposed weight); valid until :meth:`drop_gathered`."""
        if not self.accept_gathered:
            return
        if self.transposed:
            from ..format import NVFP4Storage

            def t(data, scale, amax):
                k, half_n = data.shape
                q = NVFP4Storage(data, scale, amax, torch.Size((k, 2 * half_n)), "16x16").t()
                return q.data, q.scale, q.amax

            data, scale, amax = codes
            if data.dim() == 3:  # one matrix per expert
                per = [t(data[e], scale[e], amax[e]) for e in range(data.shape[0])]
                codes = tuple(torch.stack(c) for c in zip(*per))
            else:
                codes = t(data, scale, amax)
        self._gathered = (_token(weight), codes)

    def drop_gathered(self) -> None:
        """The gathered weight was released."""
        self._gathered = None
