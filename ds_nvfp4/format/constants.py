"""Constants of the NVFP4 format (see docs/format.md and the NVIDIA TE reference).

Every value here is used in float32 arithmetic, in exactly the operation order TE (>= 2.14) uses,
so that codes and scales match TE's quantization bit for bit.
"""

from __future__ import annotations

import torch

#: Elements that share one E4M3 block scale along the reduction (last) dimension.
BLOCK_SIZE = 16
#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: Largest finite float8_e4m3fn magnitude.
E4M3_MAX = 448.0
#: 448 * 6: the per-tensor encode scale is ``E4M3_MAX * E2M1_MAX / amax``.
GLOBAL_SCALE_NUMERATOR = 2688.0
FLT_MAX = torch.finfo(torch.float32).max

#: The 16 E2M1 values indexed by their 4-bit code (bit 3 is the sign; code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

#: The only block layouts the format defines.
BLOCKS = ("1x16", "16x16")
ROUNDINGS = ("nearest", "stochastic")

#: TE's fixed sign vector of the 16-point Random Hadamard Transform (`get_wgrad_sign_vector`).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [16] lookup table from code to value."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
