"""Start-up cost of the ds_nvfp4 hook (``ds_nvfp4_autohook.pth``), which runs in every Python process.

Prints the hook module's own import time (``python -X importtime``, median of N) and the interpreter start time
(``python -c pass``, median of N) with the hook on and off (``DS_NVFP4_AUTO=0``), in the same run.
Usage: ``python bench/autohook.py [N] [--json out.json]`` (every sample and the machine kept in the JSON).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time


def start_ms(env: dict, n: int) -> list[float]:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        xs.append(1000 * (time.perf_counter() - t0))
    return xs


def hook_import_us(n: int) -> list[int]:
    xs = []
    for _ in range(n):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True).stderr
        m = re.search(r"import time:\s+(\d+) \|\s+(\d+) \|\s+ds_nvfp4_autohook", err)
        if m is None:
            sys.exit("ds_nvfp4_autohook was not imported at start-up: is ds-nvfp4 installed (pip install -e .)?")
        xs.append(int(m.group(2)))
    return xs


def main() -> None:
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int, nargs="?", default=21, help="samples of each measurement")
    ap.add_argument("--json", help="also write every sample and the machine here")
    args = ap.parse_args()
    n = args.n
    on = start_ms(dict(os.environ), n)
    off = start_ms({**os.environ, "DS_NVFP4_AUTO": "0"}, n)
    imp = hook_import_us(n)
    print(f"hook module import (cumulative, median of {n}): {statistics.median(imp) / 1000:.2f} ms")
    print(f"interpreter start (median of {n}): hook on {statistics.median(on):.1f} ms, off "
          f"{statistics.median(off):.1f} ms, ratio {statistics.median(on) / statistics.median(off):.3f}")
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _timing import context

        Path(args.json).write_text(json.dumps({**context(), "n": n, "hook_import_us": imp,
                                               "start_ms_hook_on": on, "start_ms_hook_off": off}, indent=2))


if __name__ == "__main__":
    main()
