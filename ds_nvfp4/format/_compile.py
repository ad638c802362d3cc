"""Optional torch.compile of the elementwise format kernels.

The eager kernels are the definition; compiling them (Inductor fuses the ~15 elementwise passes of a
quantize into two loops) gives the same bits 2-3x faster on CPU, which matters because the emulated
GEMM path quantizes every activation. Policy, read once from ``DS_NVFP4_COMPILE``:

- ``auto`` (default): compile on CPU when a C++ compiler is on PATH, run eager on GPUs (their eager
  kernels are memory-bound already and native paths do not use these functions);
- ``1``: compile everywhere; ``0``: never compile.

A compile failure is logged once and the eager kernel (identical bits, slower) is used from then on.
Inside an outer ``torch.compile`` trace the eager function is returned so Dynamo can trace it.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from typing import TypeVar

import torch

log = logging.getLogger("ds_nvfp4")
_RECOMPILE_LIMIT = 64
F = TypeVar("F", bound=Callable)


@functools.cache
def _policy() -> str:
    value = os.environ.get("DS_NVFP4_COMPILE", "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"DS_NVFP4_COMPILE={value!r}: allowed values are auto, 0, 1")
    return value


@functools.cache
def _have_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


def compile_enabled(device: torch.device) -> bool:
    """Whether the compiled kernels are used for tensors on ``device``."""
    policy = _policy()
    if policy == "0":
        return False
    if policy == "1":
        return True
    return device.type == "cpu" and _have_cxx()


class _Compiled:
    """A kernel that dispatches to its compiled twin when the policy allows, eager otherwise."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.compiled: Callable | None = None
        self.failed = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if self.failed or torch.compiler.is_compiling() or not compile_enabled(first.device):
            return self.fn(*args, **kwargs)
        if self.compiled is None:
            # dynamic=None: the first shape gets a static (fastest) kernel; a second shape recompiles once with
            # symbolic sizes, which then serves every later shape (no per-shape recompiles).
            self.compiled = torch.compile(self.fn, dynamic=None, fullgraph=True)
        try:
            # Each kernel is specialised on its string/dtype arguments (block layout, output dtype) and once
            # more for symbolic shapes: up to ~12 graphs for `decode`. Dynamo's default limit of 8 per function
            # would stop compiling mid-run; raise it for our own kernels only.
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                return self.compiled(*args, **kwargs)
        except Exception as exc:  # a compiler problem must not stop training: same bits, eager
            self.failed = True
            log.warning("ds_nvfp4: torch.compile of %s failed (%s); using the eager kernel "
                        "(identical results, slower). Set DS_NVFP4_COMPILE=0 to skip compiling.",
                        self.fn.__name__, exc)
            return self.fn(*args, **kwargs)


def compiled(fn: F) -> F:
    """Decorator: see the module docstring."""
    return _Compiled(fn)  # type: ignore[return-value]
