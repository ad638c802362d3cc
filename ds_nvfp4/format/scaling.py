"""`WeightScaling`: how a weight tensor's blocks are scaled, as one typed value from the config to the kernel.

Standard NVFP4 maps each block's max to 6 with a global E4M3 bound of 448; 4/6 (format/four_over_six.py) maps each
block to 4 or to 6, whichever reconstructs it with less error (``error``), usually with a bound of 256. The codes
and scales are standard NVFP4 either way: the choice lives on the encoder side only.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import four_over_six
from .constants import E4M3_MAX


@dataclass(frozen=True)
class WeightScaling:
    """``kind``: ``"6"`` (standard) or ``"4over6"``; ``e4m3_bound``: the global E4M3 bound of the per-tensor scale
    (``S_enc = 6 * bound / amax``), 448, or 256/448 with 4/6; ``error``: 4/6's metric, ``"MAE"`` or ``"MSE"``.
    Invalid combinations raise a ValueError naming the field and the allowed values."""

    kind: str = "6"
    e4m3_bound: int = int(E4M3_MAX)
    error: str = "MAE"

    def __post_init__(self) -> None:
        if self.kind not in four_over_six.SCALINGS:
            raise ValueError(f"scaling={self.kind!r}: allowed values are "
                             f"{', '.join(map(repr, four_over_six.SCALINGS))}")
        if self.kind == "6" and self.e4m3_bound != E4M3_MAX:
            raise ValueError(f"e4m3_bound={self.e4m3_bound!r}: standard NVFP4 (scaling='6') uses 448; other bounds "
                             "are for scaling='4over6'")
        if self.e4m3_bound not in four_over_six.E4M3_BOUNDS:
            raise ValueError(f"e4m3_bound={self.e4m3_bound!r}: allowed values are "
                             f"{', '.join(map(str, four_over_six.E4M3_BOUNDS))}")
        if self.error not in four_over_six.ERROR_METRICS:
            raise ValueError(f"error={self.error!r}: allowed values are "
                             f"{', '.join(map(repr, four_over_six.ERROR_METRICS))}")

    @classmethod
    def of(cls, kind: str = "6", e4m3_bound: int | None = None, error: str = "MAE") -> WeightScaling:
        """With the bound defaulted per kind (448 standard, 256 for 4/6, as Transformer Engine's)."""
        if e4m3_bound is None:
            e4m3_bound = four_over_six.DEFAULT_4OVER6_BOUND if kind == "4over6" else int(E4M3_MAX)
        return cls(kind, int(e4m3_bound), error)

    @property
    def standard(self) -> bool:
        return self.kind == "6"


STANDARD = WeightScaling()
