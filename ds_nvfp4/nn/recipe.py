"""`Recipe`: the numerics a converted Linear follows, derived from the ``precision`` section."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from ..format.scaling import STANDARD, WeightScaling


@dataclass(frozen=True)
class Recipe:
    """What is quantized how: one typed value from the config (:meth:`from_config`) to the kernel. Hashable; custom
    ops take it as a string (:meth:`encode` / :meth:`decode`, derived from the fields, so a new field needs no
    codec change).

    Attributes:
        weight_block: "16x16" or "1x16" (weights); activations are always 1x16 with a dynamic amax.
        act_hadamard: RHT of both forward GEMM operands along K.
        backward_gemm: "bf16" (Dgrad/Wgrad in BF16: FP4 forward only) or "nvfp4" (FP4 Dgrad/Wgrad too).
        stochastic_rounding: SR of the gradient operands (backward_gemm == "nvfp4" only).
        backward_hadamard: RHT of both Wgrad operands along the token dim (backward_gemm == "nvfp4" only).
        kernel: the GEMM backend name (``kernels.select`` decides it once per run).
        forward_gemm: "nvfp4", or "bf16" for Fprop in BF16 while the backward stays FP4 (``precision.schedule``'s
            late switch of the paper's recipe; the weight is still quantized, for the FP4 Dgrad).
        weight: the weights' block scaling (standard or 4/6, its E4M3 bound and error metric): every
            NVFP4Storage rebuilt from saved weight codes carries its bound.
    """

    weight_block: str = "16x16"
    act_hadamard: bool = False
    backward_gemm: str = "bf16"
    stochastic_rounding: bool = True
    backward_hadamard: bool = True
    kernel: str = "emulated"
    forward_gemm: str = "nvfp4"
    weight: WeightScaling = STANDARD

    def __post_init__(self) -> None:
        # encoded once: encode() runs on every GEMM call, and inside torch.compile graphs (which cannot trace json)
        object.__setattr__(self, "_encoded", json.dumps(dataclasses.asdict(self), sort_keys=True,
                                                        separators=(",", ":")))

    def encode(self) -> str:
        """A JSON string of the fields (the form custom ops carry)."""
        return self._encoded

    @staticmethod
    @functools.cache
    def decode(text: str) -> Recipe:
        fields = json.loads(text)
        return Recipe(**{**fields, "weight": WeightScaling(**fields["weight"])})

    @classmethod
    def from_config(cls, precision, kernel: str) -> Recipe:
        """From a validated ``PrecisionConfig`` and the selected backend name."""
        return cls(precision.weights.block, precision.activations.hadamard, precision.backward.gemm,
                   precision.backward.stochastic_rounding, precision.backward.hadamard, kernel,
                   weight=precision.weights.quantization())
