"""Small C++ kernels for the CPU encode and decode loops, built on first use by torch's JIT extension loader.

Why: on CPU, ``quantize`` spends ~85% of its time in the E2M1 encode loop and ``dequantize`` most of its time in
the decode loop, and Inductor does not vectorise them well; the plain C++ loops in ``csrc/nvfp4_cpu.cpp``
(``-O3 -march=native``) run them several times faster with the same bytes. They accelerate, they do not define:
the eager kernels in ``_kernels.py`` stay the reference, every first call per argument signature is compared with
them bit for bit (``_compile.py``), and anything that goes wrong here (no compiler, no ninja, a build error) is
logged once and leaves the Inductor or eager kernels in charge.

The build is cached (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under a name that includes a
hash of the CPU's instruction-set flags, the source, the flags, torch's and Python's versions, so a home directory
shared by different CPUs or environments never loads code built for another one. It is built once: a later process
imports the built library directly instead of asking torch's loader, which would run ninja again, and ninja
rebuilds everything whenever a different ninja version wrote the build log (a system ninja 1.11 and a virtualenv's
1.13 alternate on PATH between launches; tests/format/test_cpu_ext.py checks a second launch builds nothing).
Policy: ``DS_NVFP4_CPU_EXT=auto`` (default: used wherever the format kernels are compiled, see
``DS_NVFP4_COMPILE``) or ``0`` (never).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("ds_nvfp4")
SOURCE = Path(__file__).with_name("csrc") / "nvfp4_cpu.cpp"
#: no FMA contraction: the float32 operation order is part of the bit contract with the eager kernels;
#: -fno-trapping-math lets GCC if-convert and vectorise the rounding loops (5x on the stochastic encode) without
#: changing any result (it only drops the assumption that FP operations may trap)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]

#: why the extension is not in use (None while it is, or before the first attempt)
unavailable_reason: str | None = None


def _cpu_tag() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    import torch

    src = SOURCE.read_bytes() if SOURCE.exists() else b""
    env = f"{torch.__version__} {sys.version}".encode()
    return hashlib.sha256(flags.encode() + src + " ".join(FLAGS).encode() + env).hexdigest()[:12]


def build_directory(name: str) -> Path:
    """Where the extension ``name`` is built (torch's ``TORCH_EXTENSIONS_DIR`` convention)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "torch_extensions")
    return Path(root) / name


def _import_built(name: str, folder: Path) -> Any | None:
    """The already built library, imported without running the build system; None when there is none (or a build
    of it is in progress: torch's loader holds ``lock`` in the folder until the library is complete)."""
    library = folder / f"{name}.so"
    if not library.is_file() or (folder / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def extension() -> Any | None:
    """The loaded module (``encode_nearest(x, enc, row_div)``, ``decode(data, factor, row_div, bf16)``), or None
    (the reason is then in ``unavailable_reason``)."""
    global unavailable_reason
    if os.environ.get("DS_NVFP4_CPU_EXT", "auto").strip().lower() == "0":
        unavailable_reason = "disabled by DS_NVFP4_CPU_EXT=0"
        return None
    try:
        from torch.utils.cpp_extension import load

        name = f"ds_nvfp4_cpu_{_cpu_tag()}"
        folder = build_directory(name)
        module = _import_built(name, folder)
        if module is None:
            folder.mkdir(parents=True, exist_ok=True)
            module = load(name=name, sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                          build_directory=str(folder), verbose=False)
    except Exception as exc:  # no compiler/ninja, or a build error: the Inductor/eager kernels remain
        unavailable_reason = f"C++ kernels not built ({type(exc).__name__}: {str(exc).strip()[:300]})"
        log.warning("ds_nvfp4: %s; quantize uses the compiled/eager PyTorch kernel (same bits, slower)",
                    unavailable_reason)
        return None
    return module
