"""Optional torch.compile of the elementwise format kernels.

The eager kernels are the definition; compiling them (Inductor fuses the ~15 elementwise passes of a
quantize into two loops) gives the same bits 2-3x faster on CPU, which matters because the emulated
GEMM path quantizes every activation. Policy, read once from ``DS_NVFP4_COMPILE``:

- ``auto`` (default): compile on CPU when a C++ compiler is on PATH, run eager on GPUs (their eager
  kernels are memory-bound already and native paths do not use these functions);
- ``1``: compile everywhere; ``0``: never compile.

A compile failure is logged once and the eager kernel (identical bits, slower) is used from then on.
Inside an outer ``torch.compile`` trace the eager function is returned so Dynamo can trace it.

Compiled code is not trusted blindly: the first call with each new argument signature (shapes, dtypes, flags)
also runs the eager kernel and compares the bits. Seen here: with ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512
machine, torch 2.13's Inductor returns wrong values for ``x.view(m, n, 16).abs().amax(-1)`` (half the block maxima)
and for in-place ops on custom-op outputs; a quantization that silently used such code would be wrong everywhere.
A mismatch is logged once, names the kernel and the CPU capability, and switches that kernel to eager for the rest
of the process; :func:`status` reports it (``ds-nvfp4 env`` shows it).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

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


def _signature(args: tuple, kwargs: dict) -> tuple:
    def one(a: Any) -> Any:
        return (tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _same_bits(a: Any, b: Any) -> bool:
    """Exact equality of (tuples of) tensors, NaN payloads included (compares the raw bytes)."""
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


#: kernel name -> why it runs eager (compile failure or a verified mismatch); see :func:`status`
_EAGER: dict[str, str] = {}


def status() -> dict[str, str]:
    """Kernels that fell back to eager in this process, with the reason (empty: all compiled ones verified)."""
    return dict(_EAGER)


class _Compiled:
    """A kernel that dispatches to its compiled twin when the policy allows, eager otherwise."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.compiled: Callable | None = None
        self.failed = False
        self.verified: set[tuple] = set()
        functools.update_wrapper(self, fn)

    def _fall_back(self, why: str) -> None:
        self.failed = True
        _EAGER[self.fn.__name__] = why
        log.warning("ds_nvfp4: %s; using the eager kernel for %s (identical results, slower). Set "
                    "DS_NVFP4_COMPILE=0 to skip compiling.", why, self.fn.__name__)

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
                out = self.compiled(*args, **kwargs)
        except Exception as exc:  # a compiler problem must not stop training: same bits, eager
            self._fall_back(f"torch.compile of {self.fn.__name__} failed ({type(exc).__name__}: {exc})")
            return self.fn(*args, **kwargs)
        key = _signature(args, kwargs)
        if key not in self.verified:
            ref = self.fn(*args, **kwargs)
            if not _same_bits(out, ref):
                self._fall_back(f"Inductor's code for {self.fn.__name__} gives different bits from the eager "
                                f"kernel on this CPU (ATen capability {torch.backends.cpu.get_cpu_capability()}, "
                                f"torch {torch.__version__}, arguments {key})")
                return ref
            self.verified.add(key)
        return out


def compiled(fn: F) -> F:
    """Decorator: see the module docstring."""
    return _Compiled(fn)  # type: ignore[return-value]
