"""The three export formats: the tensors one quantized matrix becomes, and the configuration files that declare them.

Per quantized matrix (a unit's row range; 16x16 tile scales written replicated over rows, i.e. as the 1x16
``group_size: 16`` scales both NVFP4 formats expect):

| | ModelOpt (``hf_quant_config.json``) | compressed-tensors (``nvfp4-pack-quantized``) |
|---|---|---|
| codes | ``weight`` uint8 ``[N, K/2]`` | ``weight_packed`` uint8 ``[N, K/2]`` |
| block scales | ``weight_scale`` e4m3 ``[N, K/16]`` | ``weight_scale`` e4m3 ``[N, K/16]`` |
| weight global | ``weight_scale_2`` = amax/2688 (decode) | ``weight_global_scale`` fp32 ``[1]`` = 2688/amax (encode) |
| input global (W4A4) | ``input_scale`` = amax/2688 | ``input_global_scale`` fp32 ``[1]`` = 2688/amax |

A weight trained with 4/6 block scaling (``precision.weights.scaling: "4over6"``) is standard NVFP4 to a reader: its
codes and E4M3 block scales are ordinary, only its global scale divides by ``6 * e4m3_bound`` (1,536 with TE's
default bound 256) instead of 2,688, and both formats carry the global scale explicitly.
"""

from __future__ import annotations

import torch

from ..format import NVFP4Storage
from ..format.constants import E2M1_MAX, GLOBAL_SCALE_NUMERATOR

FORMATS = ("bf16", "nvfp4-modelopt", "nvfp4-compressed-tensors")


def nvfp4_tensors(fmt: str, name: str, q: NVFP4Storage, rows: slice, input_amax: float | None
                  ) -> dict[str, torch.Tensor]:
    """The tensors of module ``name`` (rows ``rows`` of the quantized matrix ``q``) in format ``fmt``;
    ``input_amax`` given: W4A4 (the static activation scale), else weights only."""
    data = q.data[rows].contiguous()
    scale = q.rowwise_scale()[rows].contiguous()
    numerator = E2M1_MAX * q.e4m3_bound  # 2688 for standard NVFP4; 1536 for 4/6 with the bound 256
    if fmt == "nvfp4-modelopt":
        out = {f"{name}.weight": data, f"{name}.weight_scale": scale,
               f"{name}.weight_scale_2": (q.amax / numerator).reshape(())}
        if input_amax is not None:
            out[f"{name}.input_scale"] = torch.tensor(input_amax / GLOBAL_SCALE_NUMERATOR)
        return out
    # compressed-tensors: fp32 shape [1], the divisor form (it and vLLM take the reciprocal; a 0-dim scalar makes
    # compressed-tensors compute in BF16)
    out = {f"{name}.weight_packed": data, f"{name}.weight_scale": scale,
           f"{name}.weight_global_scale": (numerator / q.amax).reshape(1)}
    if input_amax is not None:
        out[f"{name}.input_global_scale"] = torch.tensor([GLOBAL_SCALE_NUMERATOR / input_amax])
    return out


def compressed_tensors_config(ignore: list[str], scheme: str = "W4A16") -> dict:
    """The ``quantization_config`` compressed-tensors (and vLLM's compressed-tensors schemes) read for NVFP4."""
    args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
            "observer": "minmax"}
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**args, "dynamic": False},
            # W4A4: per-16 block scales computed at run time ("local"), the per-tensor input_global_scale static
            "input_activations": {**args, "dynamic": "local"} if scheme == "W4A4" else None,
        }},
        "ignore": ignore,
    }


def modelopt_config(ignore: list[str], scheme: str) -> dict:
    """``hf_quant_config.json`` as vLLM (``modelopt.py``) and TensorRT-LLM read it.

    ``producer.name`` must be ``"modelopt"``: vLLM selects its ModelOpt path by that name only. The layout is
    ModelOpt's unified HF format; ``ds_nvfp4`` records who wrote it.
    """
    from .._version import __version__

    return {"producer": {"name": "modelopt", "version": "unified-hf"},
            "quantization": {"quant_algo": "NVFP4" if scheme == "W4A4" else "W4A16_NVFP4",
                             "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ignore},
            "ds_nvfp4": {"version": __version__, "scheme": scheme}}
