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
    """Exact equality of (tuples of) tensors, bit for bit (-0.0 differs from 0.0), except that any NaN equals any
    NaN: a NaN's sign and payload are not part of the contract (x86 makes ``0 * inf`` a negative NaN, and
    PyTorch's own vectorised and scalar bfloat16 casts disagree on NaN bits)."""
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and a.element_size() >= 2:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return False
        a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


#: kernel name -> why it runs eager (compile failure or a verified mismatch); see :func:`status`
_EAGER: dict[str, str] = {}


def status() -> dict[str, str]:
    """Kernels that fell back to eager in this process, with the reason (empty: all compiled ones verified)."""
    return dict(_EAGER)


def _all_finite(args: tuple, kwargs: dict) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors)


class _Compiled:
    """A kernel that dispatches to a faster twin when the policy allows, eager otherwise.

    The twin is the ``native`` implementation when given and applicable (it returns None when it does not apply
    to these arguments), else ``torch.compile`` of the eager function. Either twin is checked against the eager
    kernel on the first call of every argument signature whose inputs are all finite (a poisoned, non-finite
    input has don't-care codes, e.g. the sign of a NaN, so it proves nothing and is answered by the eager kernel).
    """

    def __init__(self, fn: Callable, native: Callable | None = None) -> None:
        self.fn = fn
        self.native = native
        self.compiled: Callable | None = None
        self.failed = False          # Inductor twin unusable: eager
        self.native_failed = False   # native twin unusable: Inductor or eager
        self.verified: set[tuple] = set()
        functools.update_wrapper(self, fn)

    def _fall_back(self, why: str, native: bool = False) -> None:
        if native:
            self.native_failed = True
            _EAGER[f"{self.fn.__name__} (C++)"] = why
        else:
            self.failed = True
            _EAGER[self.fn.__name__] = why
        log.warning("ds_nvfp4: %s; using the %s kernel for %s (identical results, slower). Set "
                    "DS_NVFP4_COMPILE=0 to skip compiling.", why, "Inductor" if native else "eager",
                    self.fn.__name__)

    def _checked(self, out: Any, args: tuple, kwargs: dict, native: bool) -> Any:
        """``out`` if its signature is verified (or verifies now), else the eager result."""
        key = (native, *_signature(args, kwargs))
        if key in self.verified:
            return out
        ref = self.fn(*args, **kwargs)
        if not _all_finite(args, kwargs):
            return ref  # proves nothing either way; verify on a later, finite call
        if not _same_bits(out, ref):
            what = "the C++ kernel" if native else "Inductor's code"
            self._fall_back(f"{what} for {self.fn.__name__} gives different bits from the eager kernel on this CPU "
                            f"(ATen capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
                            f"arguments {key[1:]})", native)
            return ref
        self.verified.add(key)
        return out

    def __call__(self, *args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if torch.compiler.is_compiling() or not compile_enabled(first.device):
            return self.fn(*args, **kwargs)
        if self.native is not None and not self.native_failed:
            out = self.native(*args, **kwargs)
            if out is not None:
                return self._checked(out, args, kwargs, native=True)
        if self.failed:
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
        return self._checked(out, args, kwargs, native=False)


def compiled(fn: F | None = None, *, native: Callable | None = None) -> F:
    """Decorator (``@compiled`` or ``@compiled(native=f)``): see the module docstring and :class:`_Compiled`."""
    if fn is None:
        return functools.partial(compiled, native=native)  # type: ignore[return-value]
    return _Compiled(fn, native)  # type: ignore[return-value]
