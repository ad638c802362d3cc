"""The RHT pinned to Transformer Engine's own definition (not to this package's constant).

From TE's source, ``transformer_engine/pytorch/tensor/nvfp4_tensor.py``: ``get_wgrad_sign_vector()`` returns
``[1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]``; ``get_rht_matrix`` is
``(signs * eye(16)) @ get_hadamard_matrix(16)`` (Sylvester order, scaled by 1/sqrt(16)) cast to bfloat16; TE's
reference applies it as ``x.reshape(-1, 16) @ rht_matrix`` (``transformer_engine/jax/quantize/hadamard.py``,
``apply_rht``). The sign mask TE passes to its kernels sets bit i where sign i is -1.
"""

from __future__ import annotations

import numpy as np
import torch

import ds_nvfp4

TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def _sylvester16() -> np.ndarray:
    h = np.array([[1]])
    for _ in range(4):
        h = np.kron(np.array([[1, 1], [1, -1]]), h)
    return h


def test_rht_is_te_matrix_in_te_orientation() -> None:
    te = torch.tensor(np.diag(TE_SIGNS) @ _sylvester16() / 4.0, dtype=torch.float32).to(torch.bfloat16)
    eye = torch.eye(16, dtype=torch.bfloat16)
    # x @ H for the unit vectors: row i of H is the image of e_i
    assert torch.equal(ds_nvfp4.hadamard(eye), te)
    x = torch.randn(8, 64)
    want = (x.to(torch.bfloat16).float().reshape(-1, 16) @ te.float()).to(torch.bfloat16).reshape(8, 64)
    assert torch.equal(ds_nvfp4.hadamard(x), want)


def test_te_sign_mask() -> None:
    mask = sum(1 << i for i, s in enumerate(TE_SIGNS) if s == -1)
    assert mask == 0b1101011111101000 and mask == 55272
