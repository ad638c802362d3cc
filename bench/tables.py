"""docs/benchmarks.md's tables, generated from the kept raw output of the benchmarks (docs/evidence/bench, gpu).

Usage: python bench/tables.py [--check]
Each table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in docs/benchmarks.md and is rewritten
from its JSON (every timed call, the machine, the command: bench/_timing.py). ``--check`` rewrites nothing and exits 1
when a table in the doc differs from what its kept file gives (tests/test_benchmark_tables.py runs it), so no figure
in docs/benchmarks.md can drift from its kept output.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ds_nvfp4.kernels.cpu_allocator import GLIBC_REUSE_ENV  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
EVIDENCE = ROOT / "docs" / "evidence"


def _load(name: str) -> dict:
    return json.loads((EVIDENCE / name).read_text())


def _machine(d: dict) -> str:
    m, al = d["machine"], d.get("allocator")
    env = "".join(f"{k}={v} " for k, v in (al or {}).get("env", {}).items())
    # labelled by the setting the process started with, not by the allocator probe, which runs after the timed work
    # and there once found glibc's default reusing (docs/evidence/bench/allocator_memory/experts_default_1.json)
    reusing = al is not None and all(al.get("env", {}).get(k) == v for k, v in GLIBC_REUSE_ENV.items())
    heap = "" if al is None else (f", {al['name']} malloc " + (
        "reusing freed buffers" if reusing else "returning large freed buffers to the OS (page faults)"))
    return f"{m['name']} ({m['bf16_gemm']}), {d['threads']} threads, torch {d['torch']}{heap}; `{env}{d['command']}`"


def _samples(row: dict) -> str:
    xs = row["seconds"]
    if "round_ratios" in row:  # bench/_timing.py interleaved: each round's ratio to the baseline's call
        rs = row["round_ratios"]
        return f"{len(xs)} rounds, {min(xs):.3f}-{max(xs):.3f} s, per round {min(rs):.2f}-{max(rs):.2f}x"
    return f"{len(xs)} calls, {min(xs):.3f}-{max(xs):.3f} s"


def _quantize_table(d: dict) -> list[str]:
    out = [f"{d['header']}; {_machine(d)}", "",
           "| operation | ns / element | of copy bandwidth | median ms | calls |", "|---|---|---|---|---|"]
    for name, r in d["rows"].items():
        out.append(f"| {name} | {r['ns_per_element']:.2f} | {r['copy_bw_fraction']:.0%} | {1e3 * r['median']:.1f} | "
                   f"{len(r['seconds'])} |")
    return out


#: the sentence between a table from the AMX Xeon and its twin from the AVX512-BF16 EPYC
_EPYC = "On a 2-core AMD EPYC with AVX512-BF16 and no AMX (a shared machine whose speed drifts between runs):"


def _ratio_table(d: dict, key: str, column: str) -> list[str]:
    out = [f"{d['header']}; {_machine(d)}", "", f"| row | median s | {column} | samples |", "|---|---|---|---|"]
    for name, r in d["rows"].items():
        out.append(f"| {name} | {r['median']:.3f} | **{r[key]:.2f}x** | {_samples(r)} |")
    return out


#: the sentence before a table measured with glibc keeping freed buffers (ds_nvfp4.envcheck.GLIBC_REUSE_ENV)
_REUSE = ("The same machine in the same pause, the processes started with glibc's malloc keeping freed buffers for "
          "reuse (`ds-nvfp4 env`, section CPU allocator below):")


def _three(name: str, table) -> list[str]:
    """``table`` of the AMX Xeon's run, the EPYC's, and the EPYC's with freed buffers reused (``bench/NAME_*.json``)."""
    return [*table(_load(f"bench/{name}_amx.json")), "", _EPYC, "", *table(_load(f"bench/{name}_epyc.json")), "",
            _REUSE, "", *table(_load(f"bench/{name}_epyc_reuse.json"))]


def quantize() -> list[str]:
    return _three("quantize", _quantize_table)


def gemm() -> list[str]:
    return _three("gemm", lambda d: _ratio_table(d, "ratio_to_bf16_linear", "vs BF16 nn.Linear"))


def experts() -> list[str]:
    return _three("experts", lambda d: _ratio_table(d, "ratio_to_grouped_mm", "vs transformers grouped_mm"))


#: the benchmarks of the allocator comparison and the key of their ratio to the BF16 row
_MEMORY_BENCHES = {"experts": "ratio_to_grouped_mm", "gemm": "ratio_to_bf16_linear"}


def allocator_memory() -> list[str]:
    """Peak resident memory and speed of bench/experts.py and bench/gemm.py with glibc's default malloc and with
    freed buffers kept (``docs/evidence/bench/allocator_memory/BENCH_SETTING_N.json``, invocations alternating)."""
    folder = EVIDENCE / "bench" / "allocator_memory"
    first = _load(f"bench/allocator_memory/{min(p.name for p in folder.glob('*.json'))}")
    m = first["machine"]
    out = [f"{m['name']} ({m['bf16_gemm']}), {first['threads']} threads, torch {first['torch']}; each cell the median "
           "over the invocations (range in brackets); peak RSS of the benchmark process (`max_rss_mib`, before its "
           "allocator probe)", "",
           "| benchmark | malloc | invocations | peak RSS MiB | BF16 row s | FP4 rows vs BF16 |",
           "|---|---|---|---|---|---|"]

    def cell(xs: list[float], fmt: str, unit: str = "") -> str:
        return f"{format(statistics.median(xs), fmt)}{unit} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"

    for bench, key in _MEMORY_BENCHES.items():
        for setting, label in (("default", "glibc default"), ("reuse", "freed buffers kept")):
            runs = [json.loads(p.read_text()) for p in sorted(folder.glob(f"{bench}_{setting}_*.json"))]
            if not runs:
                continue
            base = runs[0]["baseline"]
            fp4 = [r for r in runs[0]["rows"] if r.startswith(("NVFP4", "nvfp4"))]
            ratios = "; ".join(f"{r}: {cell([d['rows'][r][key] for d in runs], '.2f', 'x')}" for r in fp4)
            rss = cell([d["max_rss_mib"] for d in runs], ".0f")
            out.append(f"| `bench/{bench}.py` | {label} | {len(runs)} | {rss} "
                       f"| {cell([d['rows'][base]['median'] for d in runs], '.3f')} | {ratios} |")
    return out


def zero() -> list[str]:
    d = _load("bench/zero.json")
    rows = d["rows"]
    base = rows["BF16 ZeRO-3"]
    out = [f"2 ranks x 1 thread, d={d['args']['d']}, {d['args']['layers']} blocks, seq 64, micro-batch 4, median of "
           f"{d['args']['steps'] - 2} steps (rank 0); {_machine(d)}", "",
           "| run | step s | vs BF16 | Linear weight bytes/rank | ratio | model-state bytes on device/rank | "
           "all-gather bytes/step (packed) | store s/step |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        gb = f"{r['gathered_bytes_per_step']:,.0f}" if r["gathered_bytes_per_step"] is not None else "-"
        st = f"{sum(r['store_seconds_per_step'].values()):.3f}" if r["store_seconds_per_step"] else "-"
        out.append(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f}x | "
                   f"{r['linear_weight_bytes']:,} | {r['linear_weight_bytes'] / base['linear_weight_bytes']:.4f}x | "
                   f"{r['device_model_state_bytes']:,} | {gb} | {st} |")
    return out


def autohook() -> list[str]:
    d = _load("bench/autohook.json")
    on, off = statistics.median(d["start_ms_hook_on"]), statistics.median(d["start_ms_hook_off"])
    return [f"median of {d['n']} each; {_machine(d)}", "",
            "| measurement | median |", "|---|---|",
            f"| `ds_nvfp4_autohook` import at start-up (`-X importtime`, cumulative) | "
            f"{statistics.median(d['hook_import_us']) / 1000:.2f} ms |",
            f"| `python -c pass`, hook on | {on:.1f} ms |",
            f"| `python -c pass`, hook off (`DS_NVFP4_AUTO=0`) | {off:.1f} ms |"]


TABLES = {"quantize": quantize, "gemm": gemm, "experts": experts, "allocator_memory": allocator_memory, "zero": zero,
          "autohook": autohook}


def render(text: str) -> str:
    for name, fn in TABLES.items():
        pattern = re.compile(rf"(<!-- table:{name} -->\n).*?(<!-- /table:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{DOC}: no <!-- table:{name} --> ... <!-- /table:{name} --> markers")
        body = "\n".join(fn())
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/benchmarks.md differs from the kept files")
    args = ap.parse_args()
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DOC}: a table differs from what its kept output gives: run python bench/tables.py",
                  file=sys.stderr)
            sys.exit(1)
        return
    DOC.write_text(new)
    print(f"wrote {len(TABLES)} tables into {DOC}")


if __name__ == "__main__":
    main()
