"""`transformer_engine`: Transformer Engine's NVFP4 GEMM (cuBLASLt) on sm_100+, when TE is installed.

Our NVFP4Tensor bits are TE's bits (docs/format.md), so the operands are wrapped in TE's own storage class
without re-quantizing and handed to ``general_gemm`` in TN layout. TE's Python API moves between releases: the
storage class is looked up under its 2.8+ and 2.x-early names, and ``general_gemm`` is called with keywords
only; ``kernels.select`` runs a smoke GEMM against ``emulated`` before accepting this backend, so an API
mismatch is an error at start-up, never a wrong result mid-run.
"""

from __future__ import annotations

import importlib
import inspect

import torch

from ..format import NVFP4Tensor
from .base import GemmBackend, Operand, check_operands, codes
from .swizzle import pad_scales


def _storage_class():
    for mod, cls in (("transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage", "NVFP4TensorStorage"),
                     ("transformer_engine.pytorch.tensor._internal.nvfp4_tensor_base", "NVFP4TensorBase")):
        try:
            return getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):
            continue
    raise ImportError("this Transformer Engine has neither NVFP4TensorStorage nor NVFP4TensorBase")


def _to_te(t: NVFP4Tensor):
    import transformer_engine_torch as tex

    m, k = t.shape
    # TE keeps amax and a padded (not yet swizzled) [roundup(M,128), roundup(K/16,4)] uint8 scale array.
    return _storage_class()(
        rowwise_data=t.data.reshape(m, k // 2),
        rowwise_scale_inv=pad_scales(t.rowwise_scale()).view(torch.uint8),
        columnwise_data=None,
        columnwise_scale_inv=None,
        amax_rowwise=t.amax.reshape(1),
        amax_columnwise=None,
        fp4_dtype=tex.DType.kFloat4E2M1,
        quantizer=None,
    )


class TransformerEngineBackend(GemmBackend):
    name = "transformer_engine"

    def mm(self, a: NVFP4Tensor | Operand, b: NVFP4Tensor | Operand, out_dtype: torch.dtype) -> torch.Tensor:
        a, b = codes(a), codes(b)
        check_operands(a, b)
        from transformer_engine.pytorch.cpp_extensions import general_gemm

        kwargs = {"out_dtype": torch.float32, "layout": "TN"}
        if "workspace" in inspect.signature(general_gemm).parameters:
            from transformer_engine.pytorch.module.base import get_workspace

            kwargs["workspace"] = get_workspace()
        # TE computes D = B @ A^T for layout TN with A the weight-like operand: A=b [N,K], B=a [M,K].
        out = general_gemm(_to_te(b), _to_te(a), **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        # TE folds both amaxes into cuBLASLt's alpha from the storage objects; that it did so exactly once is
        # what kernels.select's smoke test against `emulated` checks at start-up.
        return out.to(out_dtype)
