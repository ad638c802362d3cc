"""`transformer_engine`: Transformer Engine's NVFP4 GEMM (cuBLASLt) on sm_100+, when TE is installed.

Our NVFP4Storage bits are TE's bits (docs/format.md), so the operands are wrapped in TE's own storage class without
re-quantizing (a TE quantizer would re-derive the scales from dequantized values, which is not guaranteed to give the
same codes) and handed to ``general_gemm`` in TN layout. TE's Python API moves between releases; this backend
follows the signatures of :data:`TESTED_RANGE`, read from TE's source (tags v2.8 to v2.18 and main at 2.20.0.dev0):

* the storage class: ``transformer_engine.pytorch.tensor._internal.nvfp4_tensor_base.NVFP4TensorBase`` in 2.8,
  ``...tensor.storage.nvfp4_tensor_storage.NVFP4TensorStorage`` from 2.9 on;
* its constructor: ``rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, amax_rowwise,
  amax_columnwise, fp4_dtype, quantizer`` in 2.8-2.11, plus the required ``with_gemm_swizzled_scales`` from 2.12
  (False here: the scales are padded row-major, and TE's GEMM swizzles them itself), then optional keywords
  (``fake_dtype`` 2.14, ``row_scaled_nvfp4`` 2.16, ``nvfp4_use_4over6`` / ``nvfp4_e4m3_max`` 2.17) left at their
  defaults;
* ``general_gemm(A, B, workspace, ...)`` in 2.8-2.9, ``general_gemm(A, B, ...)`` from 2.10.

:func:`storage_kwargs` and :func:`gemm_kwargs` build the call from the installed signature (tested on CPU against
each of those signatures); ``kernels.select`` still runs a smoke GEMM against ``emulated`` before accepting this
backend, so a mismatch is an error at start-up, never a wrong result mid-run. Never run on Blackwell hardware yet.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping

import torch
from packaging.version import Version

from ..format import NVFP4Storage
from ..format.constants import E4M3_MAX
from .base import GemmBackend, Operand, check_operands, codes
from .device import DeviceInfo, fp4_tensor_cores
from .registry import register
from .swizzle import pad_scales

#: the Transformer Engine releases whose signatures this backend follows (lower inclusive, upper exclusive)
TESTED_RANGE = (Version("2.8"), Version("2.21"))

#: where each TE release keeps the NVFP4 storage class (2.8, then 2.9+)
STORAGE_CLASSES = (("transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage", "NVFP4TensorStorage"),
                   ("transformer_engine.pytorch.tensor._internal.nvfp4_tensor_base", "NVFP4TensorBase"))


def in_tested_range(version: str | None) -> bool | None:
    """Whether a TE version string lies in :data:`TESTED_RANGE` (None when TE is not installed)."""
    if version is None:
        return None
    try:
        v = Version(version.split("+")[0])
    except Exception:
        return False
    return TESTED_RANGE[0] <= Version(v.base_version) < TESTED_RANGE[1]


def storage_class():
    for mod, cls in STORAGE_CLASSES:
        try:
            return getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):
            continue
    raise ImportError("this Transformer Engine has neither NVFP4TensorStorage nor NVFP4TensorBase")


def storage_kwargs(params: Mapping[str, inspect.Parameter], t: NVFP4Storage, fp4_dtype) -> dict:
    """Keyword arguments of TE's storage constructor for ``t`` (rowwise only), for the constructor whose parameters
    are ``params``. Raises TypeError when a required parameter is one this backend does not know."""
    m, k = t.shape
    # TE's GEMM decodes a storage's global scale as amax / (6 * 448); a tensor quantized with another E4M3 bound
    # (4/6: 256) hands TE the amax that gives its own decode scale, amax * 448 / bound (one float32 rounding away
    # from amax / (6 * bound): the select smoke test's tolerance, not the emulation's bits)
    amax = t.amax if t.e4m3_bound == E4M3_MAX else t.amax * (E4M3_MAX / t.e4m3_bound)
    # TE keeps amax and a padded (not swizzled) [roundup(M,128), roundup(K/16,4)] uint8 scale array
    kwargs = {"rowwise_data": t.data.reshape(m, k // 2),
              "rowwise_scale_inv": pad_scales(t.rowwise_scale()).view(torch.uint8),
              "columnwise_data": None, "columnwise_scale_inv": None,
              "amax_rowwise": amax.reshape(1), "amax_columnwise": None,
              "fp4_dtype": fp4_dtype, "quantizer": None}
    if "with_gemm_swizzled_scales" in params:
        kwargs["with_gemm_swizzled_scales"] = False
    unknown = [n for n, p in params.items() if n not in kwargs and n not in ("cls", "self", "args", "kwargs")
               and p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unknown:
        raise TypeError(f"Transformer Engine's NVFP4 storage needs {', '.join(unknown)}, which ds_nvfp4 does not "
                        f"know (tested with TE {TESTED_RANGE[0]} <= v < {TESTED_RANGE[1]})")
    return kwargs


def gemm_kwargs(params: Mapping[str, inspect.Parameter], workspace) -> dict:
    """Keyword arguments of ``general_gemm`` besides A and B: FP32 output, TN layout, and the workspace where the
    signature still takes one (2.8-2.9). ``workspace`` is called only then."""
    kwargs = {"out_dtype": torch.float32, "layout": "TN"}
    if "workspace" in params:
        kwargs["workspace"] = workspace()
    return kwargs


def _workspace():
    from transformer_engine.pytorch.module.base import get_workspace

    return get_workspace()


def available(info: DeviceInfo) -> tuple[bool, str]:
    """FP4 tensor cores and an importable Transformer Engine."""
    cores, why = fp4_tensor_cores(info)
    if not cores:
        return False, why
    if info.te_version is None:
        return False, "Transformer Engine is not installed (pip install '.[te]')"
    return True, f"{why}; Transformer Engine {info.te_version}"


@register(preference=20, available=available)
class TransformerEngineBackend(GemmBackend):
    """TE's signatures are read once per process (:meth:`_api`), not on every GEMM."""

    name = "transformer_engine"

    @functools.cached_property
    def _api(self):
        """``(general_gemm, its keyword arguments besides A and B, TE's storage class, its constructor's
        parameters, the FP4 dtype)`` for the installed TE."""
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.cpp_extensions import general_gemm

        cls = storage_class()
        return (general_gemm, gemm_kwargs(inspect.signature(general_gemm).parameters, _workspace), cls,
                inspect.signature(cls.__new__).parameters, tex.DType.kFloat4E2M1)

    def _to_te(self, t: NVFP4Storage):
        _, _, cls, params, fp4 = self._api
        return cls(**storage_kwargs(params, t, fp4))

    def mm(self, a: NVFP4Storage | Operand, b: NVFP4Storage | Operand, out_dtype: torch.dtype) -> torch.Tensor:
        a, b = codes(a), codes(b)
        check_operands(a, b)
        general_gemm, kwargs = self._api[:2]
        # TE computes D = B @ A^T for layout TN with A the weight-like operand: A=b [N,K], B=a [M,K].
        out = general_gemm(self._to_te(b), self._to_te(a), **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        # TE folds both amaxes into cuBLASLt's alpha from the storage objects; that it did so exactly once is
        # what kernels.select's smoke test against `emulated` checks at start-up.
        return out.to(out_dtype)
