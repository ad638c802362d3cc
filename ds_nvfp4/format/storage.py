"""`NVFP4Storage`: the storage of one quantized tensor (data only; no dispatch, no autograd).

Roles follow Transformer Engine: the *quantizer* is the function :func:`ds_nvfp4.quantize` (recipe:
block layout, rounding, amax), this class is the *storage*, and the nn layer decides what to do with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import _kernels, e2m1
from .constants import BLOCK_SIZE, E4M3_MAX


@dataclass(frozen=True)
class NVFP4Storage:
    """A tensor in NVFP4: E2M1 codes, E4M3 block scales and an FP32 per-tensor amax.

    Attributes:
        data: uint8 ``[..., K/2]``, two E2M1 codes per byte, element 2i in the low nibble.
        scale: float8_e4m3fn block scales: ``[..., K/16]`` for ``"1x16"``; ``[M/16, K/16]`` for ``"16x16"``
            (one per 16x16 tile; :meth:`rowwise_scale` expands it to TE's ``[M, K/16]`` layout).
        amax: float32 0-dim per-tensor amax (NaN when the source held NaN/Inf: see :attr:`nonfinite`).
        shape: the logical (unpacked) shape ``[..., K]``.
        block: ``"1x16"`` or ``"16x16"``.
        e4m3_bound: the global E4M3 bound of the per-tensor scale (``S_enc = 6 * bound / amax``): 448 for
            standard NVFP4, 256 by default for 4/6 block scaling (format/four_over_six.py). Decoders that read an
            explicit global scale (compressed-tensors, ModelOpt) need nothing else.
    """

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    shape: torch.Size
    block: str
    e4m3_bound: float = E4M3_MAX

    @property
    def global_decode_scale(self) -> torch.Tensor:
        """float32 0-dim ``amax / (6 * e4m3_bound)`` (``amax / 2688`` for standard NVFP4)."""
        return self.amax * torch.tensor(1.0 / (6.0 * self.e4m3_bound), dtype=torch.float32, device=self.amax.device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Exact storage bytes: packed codes + one byte per block scale + 4 bytes of amax."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() + 4

    @property
    def nonfinite(self) -> torch.Tensor:
        """bool 0-dim tensor: True when the quantized source (or the given amax) held NaN or Inf.

        Such a tensor is poisoned on purpose: its amax is NaN, so every dequantized element is NaN, never a
        silently finite weight (the hardware would have turned NaN into +6). Reading it does not
        synchronise a GPU; call ``bool(t.nonfinite)`` when you want the answer.
        """
        return ~torch.isfinite(self.amax)

    def _as_2d(self) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.shape[-1]
        return self.data.reshape(-1, k // 2), self.scale.reshape(-1, k // BLOCK_SIZE)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The represented values as ``dtype`` in :attr:`shape` (computed in float32, rounded once)."""
        data, scale = self._as_2d()
        if self.e4m3_bound == E4M3_MAX:
            out = _kernels.decode(data, scale, self.amax, self.block, dtype)
        else:
            out = _kernels.decode_bounded(data, scale, self.amax, self.block, dtype, self.e4m3_bound)
        return out.reshape(self.shape)

    def block_values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``dtype`` ``[M, K]`` (2-D view of :attr:`shape`): code value times block scale, no per-tensor factor.

        Exact in float32 and in bfloat16 (at most 6 significant bits); what an FP4 tensor core multiplies before
        applying the two per-tensor decode scales to its FP32 accumulator.
        """
        data, scale = self._as_2d()
        if self.block == "16x16":
            scale = self.scale
        return _kernels.block_values(data, scale, self.block, dtype)

    def codes(self) -> torch.Tensor:
        """Unpacked uint8 codes in :attr:`shape` (for inspection and tests)."""
        return e2m1.unpack(self.data).reshape(self.shape)

    def rowwise_scale(self) -> torch.Tensor:
        """Block scales as float8_e4m3fn ``[M, K/16]`` (16x16 tile scales replicated over their 16 rows)."""
        if self.block == "1x16":
            return self.scale.reshape(-1, self.shape[-1] // BLOCK_SIZE)
        return self.scale.repeat_interleave(BLOCK_SIZE, dim=0)

    def t(self) -> NVFP4Storage:
        """The transpose of a 2-D 16x16-blocked tensor, exact (codes and tile scales move; nothing rounds).

        Only 16x16 blocking is closed under transposition; a 1x16 tensor must be re-quantized instead.
        """
        if self.block != "16x16":
            raise ValueError("NVFP4Storage.t() needs block='16x16': 1x16 blocks run along K only")
        codes = e2m1.unpack(self.data).t().contiguous()
        return replace(self, data=e2m1.pack(codes), scale=self.scale.t().contiguous(),
                       shape=torch.Size((self.shape[1], self.shape[0])))

    def to(self, device: torch.device | str) -> NVFP4Storage:
        """A copy on ``device`` (bytes unchanged)."""
        return replace(self, data=self.data.to(device), scale=self.scale.to(device), amax=self.amax.to(device))

    def __repr__(self) -> str:
        bound = "" if self.e4m3_bound == E4M3_MAX else f", e4m3_bound={self.e4m3_bound:g}"
        return (f"NVFP4Storage(shape={tuple(self.shape)}, block={self.block!r}{bound}, device={self.device}, "
                f"nbytes={self.nbytes})")
