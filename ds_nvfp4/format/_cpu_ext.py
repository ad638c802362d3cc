"""Small C++ kernels for the CPU encode and decode loops, built on first use by torch's JIT extension loader.

Why: on CPU, ``quantize`` spends ~85% of its time in the E2M1 encode loop and ``dequantize`` most of its time in
the decode loop, and Inductor does not vectorise them well; the plain C++ loops in ``csrc/nvfp4_cpu.cpp``
(``-O3 -march=native``) run them several times faster with the same bytes. They accelerate, they do not define:
the eager kernels in ``_kernels.py`` stay the reference, every first call per argument signature is compared with
them bit for bit (``_compile.py``), and anything that goes wrong here (no compiler, no ninja, a build error) is
logged once and leaves the Inductor or eager kernels in charge.

The build is cached by torch (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under a name that
includes a hash of the CPU's instruction-set flags and of the source, so a home directory shared by different CPUs
never loads code built for another one. Policy: ``DS_NVFP4_CPU_EXT=auto`` (default: used wherever the format
kernels are compiled, see ``DS_NVFP4_COMPILE``) or ``0`` (never).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
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
    src = SOURCE.read_bytes() if SOURCE.exists() else b""
    return hashlib.sha256(flags.encode() + src + " ".join(FLAGS).encode()).hexdigest()[:12]


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

        module = load(name=f"ds_nvfp4_cpu_{_cpu_tag()}", sources=[str(SOURCE)], extra_cflags=FLAGS,
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler/ninja, or a build error: the Inductor/eager kernels remain
        unavailable_reason = f"C++ kernels not built ({type(exc).__name__}: {str(exc).strip()[:300]})"
        log.warning("ds_nvfp4: %s; quantize uses the compiled/eager PyTorch kernel (same bits, slower)",
                    unavailable_reason)
        return None
    return module
