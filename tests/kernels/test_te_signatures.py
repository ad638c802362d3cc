"""The Transformer Engine backend builds its calls from the installed signatures; checked here against the
signatures of every TE release it claims (read from TE's source: tags v2.8-v2.18, main at 2.20.0.dev0)."""

from __future__ import annotations

import inspect

import pytest
import torch
from packaging.version import Version

import ds_nvfp4
from ds_nvfp4.kernels import transformer_engine as te_backend

_BASE = ["cls", "rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax_rowwise",
         "amax_columnwise", "fp4_dtype", "quantizer"]
_SWIZZLED = [*_BASE, "with_gemm_swizzled_scales"]
#: NVFP4 storage constructor (``__new__``) per release: required names, then keywords with defaults
STORAGE = {
    "2.8": (_BASE, []),  # NVFP4TensorBase (tensor/_internal/nvfp4_tensor_base.py)
    "2.9": (_BASE, []),  # NVFP4TensorStorage from here on (tensor/storage/nvfp4_tensor_storage.py)
    "2.11": (_BASE, []),
    "2.12": (_SWIZZLED, []),
    "2.14": (_SWIZZLED, ["fake_dtype"]),
    "2.16": (_SWIZZLED, ["fake_dtype", "row_scaled_nvfp4"]),
    "2.17": (_SWIZZLED, ["fake_dtype", "row_scaled_nvfp4", "nvfp4_use_4over6",
                                                     "nvfp4_e4m3_max"]),
    "2.20.0.dev0": (_SWIZZLED, ["fake_dtype", "row_scaled_nvfp4", "nvfp4_use_4over6",
                                                            "nvfp4_e4m3_max"]),
}
#: ``general_gemm`` (cpp_extensions/gemm.py): the workspace argument left after 2.9
GEMM = {"2.8": ["A", "B", "workspace", "out_dtype", "quantization_params", "layout"],
        "2.9": ["A", "B", "workspace", "out_dtype", "quantization_params", "layout"],
        "2.10": ["A", "B", "out_dtype", "quantization_params", "layout"],
        "2.20.0.dev0": ["A", "B", "out_dtype", "quantization_params", "layout"]}


def _signature(required: list[str], optional: list[str]) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(n, kind) for n in required]
    params.append(inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL))
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in optional]
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


@pytest.mark.parametrize("version", sorted(STORAGE))
def test_the_storage_call_binds_to_each_claimed_release(version: str) -> None:
    sig = _signature(*STORAGE[version])
    t = ds_nvfp4.quantize(torch.randn(32, 64), block="16x16")
    kwargs = te_backend.storage_kwargs(sig.parameters, t, fp4_dtype="kFloat4E2M1")
    sig.bind(None, **kwargs)  # every required parameter given, nothing unknown
    assert ("with_gemm_swizzled_scales" in kwargs) == (Version(version) >= Version("2.12"))
    assert kwargs.get("with_gemm_swizzled_scales") in (None, False)  # our scales are padded, not swizzled
    assert kwargs["rowwise_data"].shape == (32, 32) and kwargs["rowwise_scale_inv"].shape == (128, 4)
    assert kwargs["amax_rowwise"].shape == (1,)


def test_an_unknown_required_parameter_is_an_error_that_names_it() -> None:
    sig = _signature([*_SWIZZLED, "new_required_thing"], [])
    t = ds_nvfp4.quantize(torch.randn(16, 32), block="16x16")
    with pytest.raises(TypeError, match="new_required_thing"):
        te_backend.storage_kwargs(sig.parameters, t, fp4_dtype="kFloat4E2M1")


@pytest.mark.parametrize("version", sorted(GEMM))
def test_the_gemm_call_binds_to_each_claimed_release(version: str) -> None:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    sig = inspect.Signature([inspect.Parameter(n, kind, default=None if i > 1 else inspect.Parameter.empty)
                             for i, n in enumerate(GEMM[version])])
    called = []
    kwargs = te_backend.gemm_kwargs(sig.parameters, lambda: called.append(1) or "ws")
    sig.bind("a", "b", **kwargs)
    assert kwargs["layout"] == "TN" and kwargs["out_dtype"] == torch.float32
    assert bool(called) == ("workspace" in GEMM[version])


def test_tested_range_covers_the_claimed_releases() -> None:
    for v in ("2.8.0", "2.12.0", "2.18.0", "2.20.0.dev0+abc"):
        assert te_backend.in_tested_range(v), v
    assert te_backend.in_tested_range("2.7.1") is False and te_backend.in_tested_range("3.0") is False
    assert te_backend.in_tested_range(None) is None


def test_a_4over6_storage_hands_te_the_amax_of_its_decode_scale() -> None:
    """TE decodes amax / (6 * 448); a 4/6 tensor at the 256 bound decodes amax / (6 * 256): TE gets amax * 448/256."""
    sig = _signature(*STORAGE[sorted(STORAGE)[-1]])
    t = ds_nvfp4.quantize(torch.randn(32, 64), block="16x16", scaling="4over6")
    kwargs = te_backend.storage_kwargs(sig.parameters, t, fp4_dtype="kFloat4E2M1")
    te_decode = kwargs["amax_rowwise"].reshape(()) / 2688.0
    assert torch.allclose(te_decode, t.global_decode_scale, rtol=2 ** -23, atol=0)
    standard = ds_nvfp4.quantize(torch.randn(32, 64), block="16x16")
    assert torch.equal(te_backend.storage_kwargs(sig.parameters, standard, "kFloat4E2M1")["amax_rowwise"],
                       standard.amax.reshape(1))
