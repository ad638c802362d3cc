"""The one interface every FP4 GEMM backend implements.

All GEMMs are "TN": ``mm(a, b) = a @ b.T`` with ``a`` ``[M, K]`` and ``b`` ``[N, K]``, both quantized along K
(their last dim), which is the only layout the FP4 tensor cores take. The nn layer builds Fprop, Dgrad and
Wgrad out of it by choosing which tensors to quantize along which dimension.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..format import NVFP4Storage, quantize
from ..format.constants import E4M3_MAX


@dataclass(frozen=True)
class Operand:
    """One GEMM operand ``[M, K]``, quantized along K, in the form its backend multiplies.

    Attributes:
        amax: float32 0-dim per-tensor amax (its decode scale goes into the GEMM's alpha).
        tensor: the NVFP4 codes and scales (what native backends multiply; kept when asked for), or None.
        values: the ``emulated`` backend's operand: block values (E2M1 value times E4M3 scale, no per-tensor
            factor; exact) ``[M, K]`` in the device's operand dtype (kernels/operand.py), or None.
    """

    amax: torch.Tensor
    tensor: NVFP4Storage | None = None
    values: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape if self.values is not None else self.tensor.shape)  # type: ignore[union-attr]

    def t(self) -> Operand:
        """The transpose (16x16-blocked tensors only: exact, nothing rounds). Values transpose as a view; the
        codes are transposed only when no values stand in for them."""
        if self.values is not None:
            if self.tensor is not None and self.tensor.block != "16x16":
                raise ValueError("Operand.t() needs block='16x16': 1x16 blocks run along K only")
            return Operand(self.amax, None, self.values.t())
        return Operand(self.amax, self.tensor.t(), None)  # type: ignore[union-attr]


@dataclass(frozen=True)
class GroupedOperand:
    """Groups of rows quantized along K, each group with its own per-tensor amax (MoE experts: the tokens of each
    expert, or each expert's weight ``[N, K]`` stacked to ``[E*N, K]``); see ``format/grouped.py``.

    Attributes:
        amax: float32 ``[G]`` per-group amax.
        scale: float8_e4m3fn block scales (``[M, K/16]``, or ``[M/16, K/16]`` for 16x16 tiles).
        data: uint8 packed codes ``[M, K/2]`` when kept, else None.
        values: the emulated backend's operand values ``[M, K]`` (E2M1 value times E4M3 scale), or None.
        block: ``"1x16"`` or ``"16x16"``.
    """

    amax: torch.Tensor
    scale: torch.Tensor
    data: torch.Tensor | None
    values: torch.Tensor | None
    block: str = "1x16"


class GemmBackend(ABC):
    """A way to multiply two NVFP4 operands. Stateless; one instance per process is enough.

    ``quantize`` and ``operand`` produce the operands (by default the NVFP4 codes: what FP4 tensor cores read);
    a backend that multiplies something else (``emulated``) overrides them to produce it in one pass.
    """

    name: str

    def quantize(self, x: torch.Tensor, *, block: str = "1x16", rounding: str = "nearest",
                 amax: torch.Tensor | None = None, keep_codes: bool = False, scaling: str = "6",
                 e4m3_bound: int | None = None, error: str = "MAE") -> Operand:
        """Quantize a 2-D ``x`` ``[M, K]`` along K into this backend's operand (arguments as ``ds_nvfp4.quantize``;
        ``keep_codes``: the operand must also hold the NVFP4 codes, e.g. to save them for a backward)."""
        q = quantize(x, block=block, rounding=rounding, amax=amax, scaling=scaling, e4m3_bound=e4m3_bound,
                     error=error)
        return Operand(q.amax, q, None)

    def operand(self, q: NVFP4Storage | Operand) -> Operand:
        """An already quantized tensor as this backend's operand."""
        return q if isinstance(q, Operand) else Operand(q.amax, q, None)

    @abstractmethod
    def mm(self, a: NVFP4Storage | Operand, b: NVFP4Storage | Operand, out_dtype: torch.dtype) -> torch.Tensor:
        """``a @ b.T`` as ``out_dtype`` ``[M, N]``: FP32 accumulation, both per-tensor decode scales applied."""

    #: whether :meth:`grouped_linear` runs one grouped GEMM (False: the nn layer runs one GEMM per group)
    grouped = False

    def quantize_grouped(self, x: torch.Tensor, row_group: torch.Tensor, groups: int, *, block: str = "1x16",
                         amax: torch.Tensor | None = None, keep_codes: bool = False) -> GroupedOperand:
        """Quantize the row groups of ``x`` ``[M, K]`` (``row_group [M]`` int64), each with its own amax (``amax``
        ``[groups]`` overrides), in one call: ``format.grouped.quantize_grouped`` into this backend's operand."""
        raise NotImplementedError(f"{self.name}: no grouped GEMM (one GEMM per expert instead)")

    def grouped_linear(self, a: GroupedOperand, b: GroupedOperand, offsets: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [M, N], nonfinite)``: the rows of ``a``'s group ``g`` (rows sorted by group, group ``g`` ending at
        ``offsets[g]``) times ``b``'s group ``g`` (``[N, K]`` of the stacked ``[G*N, K]``), FP32 accumulation, both
        groups' decode scales applied, plus ``bias[g]`` (``bias`` ``[G, N]``)."""
        raise NotImplementedError(f"{self.name}: no grouped GEMM (one GEMM per expert instead)")

    def linear(self, a: NVFP4Storage | Operand, b: NVFP4Storage | Operand, bias: torch.Tensor | None,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, nonfinite)``: ``out_dtype(a @ b.T + bias)`` with the bias added to the FP32 result, and a bool
        0-dim tensor telling whether any output is NaN/Inf (no host sync)."""
        acc = self.mm(a, b, torch.float32)
        if bias is not None:
            acc = acc + bias.float()
        out = acc.to(out_dtype)
        return out, ~torch.isfinite(out).all()


def codes(t: NVFP4Storage | Operand) -> NVFP4Storage:
    """The NVFP4 codes of an operand (what native FP4 GEMMs read)."""
    if isinstance(t, NVFP4Storage):
        return t
    if t.tensor is None:
        raise ValueError("this operand holds only emulated values; quantize it with keep_codes=True")
    return t.tensor


def global_alpha(a: NVFP4Storage | Operand, b: NVFP4Storage | Operand) -> torch.Tensor:
    """float32 0-dim ``amax_a * amax_b / 2688^2``: the product of the two per-tensor decode scales.

    cuBLASLt receives exactly this as ``alpha`` (the note: ``amax_A * amax_B / (36 * 448^2)``); every backend
    applies it to the FP32 accumulator in the same order so their outputs agree.
    """
    # an operand quantized with another global E4M3 bound (4/6: 256) decodes with 6 * bound instead of 2688
    # (an Operand without codes holds emulated values of standard NVFP4: 448)
    na, nb = (6.0 * getattr(t if isinstance(t, NVFP4Storage) else t.tensor, "e4m3_bound", E4M3_MAX) for t in (a, b))
    inv = torch.tensor(1.0 / (na * nb), dtype=torch.float32, device=a.amax.device)
    return (a.amax * b.amax) * inv


def check_operands(a: NVFP4Storage | Operand, b: NVFP4Storage | Operand) -> None:
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"FP4 GEMM needs a [M, K] and b [N, K] with the same K; got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
