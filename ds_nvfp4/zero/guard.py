"""Every private DeepSpeed name ds_nvfp4 touches, checked once at ``initialize`` (never mid-training).

DeepSpeed's ZeRO-3 internals move between releases. This module is the only place that knows which names
the store needs; ``check_engine`` raises :class:`UnsupportedDeepSpeed` with the installed version when one is
missing, so an upgrade fails at start-up with a message instead of corrupting weights later.
"""

from __future__ import annotations

from packaging.version import Version

#: the DeepSpeed releases the ZeRO-3 store was tested with (lower inclusive, upper exclusive)
TESTED_RANGE = (Version("0.19.8"), Version("0.20"))

OPTIMIZER_METHODS = ("_reassign_or_swap_out_partitioned_parameters", "load_state_dict",
                     "_restore_from_bit16_weights", "step")
OPTIMIZER_ATTRS = ("fp16_groups", "fp16_partitioned_groups", "fp16_partitioned_groups_flat",
                   "fp32_partitioned_groups_flat", "sub_group_process_groups")
PARAM_ATTRS = ("ds_tensor", "ds_numel", "ds_shape", "ds_status", "ds_id", "all_gather", "all_gather_coalesced",
               "partition")


class UnsupportedDeepSpeed(RuntimeError):
    """The installed DeepSpeed lacks a name the NVFP4 ZeRO-3 store relies on."""


def deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def check_version(allow_untested: bool = False) -> str | None:
    """Returns a warning text for a release outside the tested range (or raises unless allowed)."""
    v = Version(deepspeed_version().split("+")[0])
    lo, hi = TESTED_RANGE
    if lo <= v < hi:
        return None
    msg = (f"DeepSpeed {v} is outside the range ds_nvfp4's ZeRO-3 storage was tested with ({lo} <= v < {hi}); "
           "private names are checked below, but behaviour may differ")
    if not allow_untested:
        raise UnsupportedDeepSpeed(msg + "; set DS_NVFP4_ALLOW_UNTESTED_DEEPSPEED=1 to try anyway, or use "
                                         'precision.weights.storage: "bf16"')
    return msg


def check_engine(optimizer, params) -> None:
    """Raise UnsupportedDeepSpeed naming the first missing private name (and the DeepSpeed version)."""
    missing = [f"optimizer.{n}" for n in OPTIMIZER_METHODS + OPTIMIZER_ATTRS if not hasattr(optimizer, n)]
    for p in params:
        missing += [f"parameter.{n}" for n in PARAM_ATTRS if not hasattr(p, n)]
        break
    try:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: F401
    except ImportError:
        missing.append("deepspeed.runtime.zero.partition_parameters.ZeroParamStatus")
    if missing:
        raise UnsupportedDeepSpeed(f"DeepSpeed {deepspeed_version()} lacks {', '.join(sorted(set(missing)))}, which "
                                   'NVFP4 ZeRO-3 storage needs; use precision.weights.storage: "bf16" or a DeepSpeed '
                                   f"in {TESTED_RANGE[0]} <= v < {TESTED_RANGE[1]}")
