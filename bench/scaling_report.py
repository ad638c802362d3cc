"""Tables, fits and the plot of bench/multihost.py's results (docs/scaling.md).

    python bench/scaling_report.py docs/evidence/scaling/multihost.json --plot docs/scaling_measured.png

Prints, per host count and configuration: step time and tokens/s at every rate (and the ratio to BF16 ZeRO-3 of
the same rate), the bytes per step and rank each collective family moved (counted) beside the analytic bytes
(ds_nvfp4.zero.traffic), the bytes the NIC sent, and a least-squares fit ``step = compute + slope x NIC bytes /
rate`` over the shaped rates: ``compute`` is the step without the link's cost, ``slope`` the exposed fraction of
the transfer time (1: none of it overlaps compute).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABEL = {"bf16": "BF16 ZeRO-3", "nvfp4_bf16_gather": "NVFP4 packed, BF16 gathers",
         "nvfp4_nvfp4_gather": "NVFP4 packed, NVFP4 gathers", "nvfp4_fp32_rs": "NVFP4 gathers, FP32 reduce-scatter",
         "qwz": "BF16 + ZeRO++ qwZ"}


def fit(rows: list[dict]) -> tuple[float, float] | None:
    """(compute s, slope) of step_s = compute + slope * nic_bytes / (rate bytes/s) over the shaped rows."""
    pts = [(r["nic_tx"] * 8 / (r["rate_mbit"] * 1e6), r["step_s"]) for r in rows if r["rate_mbit"] > 0]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return my - slope * mx, slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--plot")
    args = ap.parse_args()
    rows = [r for r in json.loads(args.results.read_text()) if "error" not in r]
    for r in rows:
        r["nic_tx"] = max(k["nic_tx_bytes_per_step"] for k in r["ranks"])
    errors = [r for r in json.loads(args.results.read_text()) if "error" in r]
    worlds = sorted({r["world"] for r in rows})
    rates = sorted({r["rate_mbit"] for r in rows}, key=lambda x: (x == 0, -x))
    configs = [c for c in LABEL if any(r["config"] == c for r in rows)]
    by = {(r["world"], r["rate_mbit"], r["config"]): r for r in rows}
    m0 = max(rows, key=lambda r: r["fp4_params"])
    print(f"model {m0['model']} ({m0['params']:,} params, {m0['fp4_params']:,} NVFP4 with the default preset), "
          f"micro-batch {m0['micro']} x {m0['seq']} tokens per rank, median of {m0['steps']} steps after "
          f"{m0['warmup']} (the slowest rank's median)\n")
    print("| hosts | Mbit/s | " + " | ".join(LABEL[c] + " s/step (x BF16)" for c in configs) + " |")
    print("|---|---|" + "---|" * len(configs))
    for w in worlds:
        for rate in rates:
            base = by.get((w, rate, "bf16"))
            cells = []
            for c in configs:
                r = by.get((w, rate, c))
                cells.append("-" if r is None else f"{r['step_s']:.2f} ({r['step_s'] / base['step_s']:.2f}x)" if base
                             else f"{r['step_s']:.2f}")
            print(f"| {w} | {'unshaped' if rate == 0 else f'{rate:g}'} | " + " | ".join(cells) + " |")
    print("\nbytes per step and rank (MB): counted payload by family / analytic (2 gather passes) / NIC sent")
    print("| hosts | configuration | all-gather counted | all-gather analytic | reduce-scatter counted | "
          "reduce-scatter analytic | other collectives | NIC sent | RS share of counted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in worlds:
        for c in configs:
            r = next((by[k] for k in sorted(by) if k[0] == w and k[2] == c), None)
            if r is None:
                continue
            cnt = r["ranks"][0]["counted_per_step"]
            ag, rs = cnt.get("all_gather", {}).get("bytes", 0), cnt.get("reduce_scatter", {}).get("bytes", 0)
            other = sum(v["bytes"] for k, v in cnt.items() if k not in ("all_gather", "reduce_scatter"))
            a = r["analytic_per_step"]
            print(f"| {w} | {LABEL[c]} | {ag / 1e6:.1f} | {a['gather_bytes'] / 1e6:.1f} | {rs / 1e6:.1f} | "
                  f"{a['reduce_scatter_bytes'] / 1e6:.1f} | {other / 1e6:.3f} | {r['nic_tx'] / 1e6:.1f} | "
                  f"{rs / (ag + rs):.0%} |")
    print("\nfit over the shaped rates: step = compute + slope x NIC bytes / rate")
    print("| hosts | configuration | compute s | slope | unshaped step s |")
    print("|---|---|---|---|---|")
    fits = {}
    for w in worlds:
        for c in configs:
            pts = [r for r in rows if r["world"] == w and r["config"] == c]
            f = fit(pts)
            if f is None:
                continue
            fits[(w, c)] = f
            un = by.get((w, 0, c))
            print(f"| {w} | {LABEL[c]} | {f[0]:.2f} | {f[1]:.2f} | {un['step_s']:.2f} |" if un else
                  f"| {w} | {LABEL[c]} | {f[0]:.2f} | {f[1]:.2f} | - |")
    for r in errors:
        print(f"\n{r['world']} hosts, {r['rate_mbit']:g} Mbit/s, {r['config']}: did not run: {r['error'][:400]}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {"bf16": "tab:gray", "nvfp4_bf16_gather": "tab:blue", "nvfp4_nvfp4_gather": "tab:red",
                  "nvfp4_fp32_rs": "tab:orange", "qwz": "tab:green"}
        shaped = [w for w in worlds if any(r["world"] == w and r["rate_mbit"] > 0 for r in rows)]
        fig, axes = plt.subplots(1, len(shaped), figsize=(6 * len(shaped), 4.2), squeeze=False)
        for ax, w in zip(axes[0], shaped):
            for c in configs:
                pts = sorted((r["rate_mbit"], r) for r in rows if r["world"] == w and r["config"] == c
                             and r["rate_mbit"] > 0)
                ax.plot([p for p, _ in pts], [r["tokens_per_s"] for _, r in pts], "o-", color=colors[c],
                        label=LABEL[c])
                un = by.get((w, 0, c))
                if un:
                    ax.axhline(un["tokens_per_s"], color=colors[c], ls=":", lw=1)
                if (w, c) in fits:
                    comp, slope = fits[(w, c)]
                    xs = [p for p, _ in pts]
                    nic = sum(r["nic_tx"] for _, r in pts) / len(pts)
                    ax.plot(xs, [w * m0["micro"] * m0["seq"] / (comp + slope * nic * 8 / (x * 1e6)) for x in xs],
                            "--", color=colors[c], lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("link rate per host and direction, Mbit/s (tc tbf)")
            ax.set_ylabel("tokens/s (all ranks)")
            ax.set_title(f"{w} hosts x 1 rank, {m0['model']} model (dotted: unshaped; dashed: fit)", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
