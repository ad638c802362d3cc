"""Start-up cost of the ds_nvfp4 hook (``ds_nvfp4_autohook.pth``), which runs in every Python process.

Prints the hook module's own import time (``python -X importtime``, median of N) and the interpreter start time
(``python -c pass``, median of N) with the hook on and off (``DS_NVFP4_AUTO=0``), in the same run.
Usage: ``python bench/autohook.py [N]``.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time


def start_ms(env: dict, n: int) -> float:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        xs.append(time.perf_counter() - t0)
    return 1000 * statistics.median(xs)


def hook_import_us(n: int) -> float:
    xs = []
    for _ in range(n):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True).stderr
        m = re.search(r"import time:\s+(\d+) \|\s+(\d+) \|\s+ds_nvfp4_autohook", err)
        if m is None:
            sys.exit("ds_nvfp4_autohook was not imported at start-up: is ds-nvfp4 installed (pip install -e .)?")
        xs.append(int(m.group(2)))
    return statistics.median(xs)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    on = start_ms(dict(os.environ), n)
    off = start_ms({**os.environ, "DS_NVFP4_AUTO": "0"}, n)
    print(f"hook module import (cumulative, median of {n}): {hook_import_us(n) / 1000:.2f} ms")
    print(f"interpreter start (median of {n}): hook on {on:.1f} ms, off {off:.1f} ms, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
