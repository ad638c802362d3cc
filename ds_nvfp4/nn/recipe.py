"""`Recipe`: the numerics a converted Linear follows, derived from the ``precision`` section."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    """What is quantized how. Hashable and serialisable to a short string (custom ops take strings).

    Attributes:
        weight_block: "16x16" or "1x16" (weights); activations are always 1x16 with a dynamic amax.
        act_hadamard: RHT of both forward GEMM operands along K.
        backward_gemm: "bf16" (Dgrad/Wgrad in BF16: FP4 forward only) or "nvfp4" (FP4 Dgrad/Wgrad too).
        stochastic_rounding: SR of the gradient operands (backward_gemm == "nvfp4" only).
        backward_hadamard: RHT of both Wgrad operands along the token dim (backward_gemm == "nvfp4" only).
        kernel: the GEMM backend name (``kernels.select`` decides it once per run).
        forward_gemm: "nvfp4", or "bf16" for Fprop in BF16 while the backward stays FP4 (``precision.schedule``'s
            late switch of the paper's recipe; the weight is still quantized, for the FP4 Dgrad).
        weight_scaling: "6" (standard NVFP4) or "4over6" (format/four_over_six.py); weights only.
        weight_bound: the global E4M3 bound of the weights' per-tensor scale (448 standard; 256 or 448 with 4/6):
            every NVFP4Storage rebuilt from saved weight codes carries it.
        weight_error: 4/6's error metric, "MAE" or "MSE".
    """

    weight_block: str = "16x16"
    act_hadamard: bool = False
    backward_gemm: str = "bf16"
    stochastic_rounding: bool = True
    backward_hadamard: bool = True
    kernel: str = "emulated"
    forward_gemm: str = "nvfp4"
    weight_scaling: str = "6"
    weight_bound: int = 448
    weight_error: str = "MAE"

    def encode(self) -> str:
        return "|".join([self.weight_block, str(int(self.act_hadamard)), self.backward_gemm,
                         str(int(self.stochastic_rounding)), str(int(self.backward_hadamard)), self.kernel,
                         self.forward_gemm, self.weight_scaling, str(self.weight_bound), self.weight_error])

    @staticmethod
    @functools.cache
    def decode(text: str) -> Recipe:
        wb, ah, bg, sr, bh, k, fg, ws, wbound, we = text.split("|")
        return Recipe(wb, ah == "1", bg, sr == "1", bh == "1", k, fg, ws, int(wbound), we)

    def weight_quantization(self) -> dict:
        """The keyword arguments of ``ds_nvfp4.quantize`` (and ``GemmBackend.quantize``) that quantize a weight the
        way this recipe does, besides ``block`` and ``amax``: ``scaling``, ``e4m3_bound``, ``error``."""
        return {"scaling": self.weight_scaling, "e4m3_bound": self.weight_bound, "error": self.weight_error}

    @classmethod
    def from_config(cls, precision, kernel: str) -> Recipe:
        """From a validated ``PrecisionConfig`` and the selected backend name."""
        w = precision.weights.quantization()
        return cls(precision.weights.block, precision.activations.hadamard, precision.backward.gemm,
                   precision.backward.stochastic_rounding, precision.backward.hadamard, kernel,
                   weight_scaling=w["scaling"], weight_bound=w["e4m3_bound"], weight_error=w["error"])
