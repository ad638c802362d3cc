"""The final validation-loss gap (NVFP4 vs BF16, with its 95% CI) against model size, from `ds-nvfp4 compare` reports.

    python bench/gap_vs_size.py runs/evidence_{1m,5m,10m}/report_nvfp4_zero3 \
        --variant runs/evidence_10m/report_nvfp4_zero3_bf16_warmup50 \
        --out docs/results_gap_vs_size.png --json docs/results_gap_vs_size.json
    # a series: --variant docs/evidence/1m/report_X="recipe X" --variant docs/evidence/5m/report_X="recipe X"
    python bench/gap_vs_size.py docs/evidence/{1m,5m,10m}/report_nvfp4_zero3 ...   # from the kept evidence
    # seed sets (`ds-nvfp4 compare --baselines ... --candidates ... --out DIR`): the mean paired gap with its 95% t
    # interval across seeds, each pair's gap drawn beside it
    python bench/gap_vs_size.py docs/evidence/v3/1m/seedset_5 docs/evidence/v3/5m/seedset_4 \
        docs/evidence/v3/10m/seedset_3 --out docs/results_gap_vs_size_v3.png --json docs/results_gap_vs_size_v3.json

Each argument is a report directory written by ``ds-nvfp4 compare --out DIR`` (its report.json names the two runs;
the parameter count comes from the candidate run's summary.json). A report kept by bench/keep_evidence.sh names
``runs/...`` paths that no longer exist; its candidate is then the directory of the same name next to the report
(docs/evidence/10m/report_X -> docs/evidence/10m/X), whose summary may be gzipped. Prints one table row per report,
writes the plot and, with ``--json``, the points (so the figure can be redrawn without the run directories).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def _run_dir(named: str, report_dir: Path) -> Path:
    """The run a report names, or, where that path is gone (kept evidence), its namesake beside the report."""
    p = Path(named)
    return p if p.is_dir() else report_dir.parent / p.name


def _read_json(path: Path) -> dict:
    """``path``, or ``path`` + ".gz" as bench/keep_evidence.sh keeps summaries."""
    if path.exists():
        return json.loads(path.read_text())
    return json.loads(gzip.decompress((path.parent / (path.name + ".gz")).read_bytes()))


def points(report_dirs: list[str]) -> list[dict]:
    """One point per ``DIR`` or ``DIR=LABEL`` (the label names a series: points with one label are joined)."""
    out = []
    for arg in report_dirs:
        d, _, label = arg.partition("=")
        rep = json.loads((Path(d) / "report.json").read_text())
        if "pairs" in rep:  # a seed set: its mean paired gap and t interval; the candidate of its first pair
            loss = {"value": rep["mean"], "ci": rep["ci"], "verdict": rep["verdict"]}
            first = rep["pairs"][0]
            rep = {"candidate": first["candidate"], "baseline": first["baseline"],
                   "pair_gaps": [p["gap"] for p in rep["pairs"]]}
        else:
            loss = next(c for c in rep["criteria"] if c["unit"] == "relative")
        run = _run_dir(rep["candidate"], Path(d))
        summary, cfg = _read_json(run / "summary.json"), _read_json(run / "config.json")
        out.append({"report": str(d), "params": summary["params"], "steps": summary["steps"],
                    "tokens": summary["steps"] * cfg["args"]["seq"] * cfg["ds_config"]["train_micro_batch_size_per_gpu"]
                    * cfg["world_size"] * cfg["ds_config"].get("gradient_accumulation_steps", 1),
                    "gap": loss["value"], "ci": loss["ci"], "verdict": loss["verdict"],
                    "candidate": rep["candidate"], "baseline": rep["baseline"], "label": label or None,
                    **({"pair_gaps": rep["pair_gaps"]} if "pair_gaps" in rep else {})})
    return sorted(out, key=lambda p: p["params"])


def _name(p: dict) -> str:
    """A point's name: its report directory's, less the "report_" of `compare --out` (report_X compares run X)."""
    return Path(p["report"]).name.removeprefix("report_")


def _yerr(pts: list[dict]) -> list[list[float]]:
    """matplotlib's asymmetric error bars (percent): distance from each gap down to and up to its CI."""
    return [[100 * (p["gap"] - p["ci"][0]) for p in pts], [100 * (p["ci"][1] - p["gap"]) for p in pts]]


def plot(pts: list[dict], path: Path, threshold: float = 0.01, variants: list[dict] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6.0))
    x = [p["params"] / 1e6 for p in pts]
    y = [100 * p["gap"] for p in pts]
    sets = all("pair_gaps" in p for p in pts)
    ax.errorbar(x, y, yerr=_yerr(pts), fmt="o-", capsize=5, color="tab:red",
                label="default preset as shipped vs BF16: mean paired gap over seeds, 95% t interval" if sets
                else "default preset as shipped vs BF16 (seed 0), 95% CI")
    for xi, yi, p in zip(x, y, pts):
        seeds = f", {len(p['pair_gaps'])} seeds" if "pair_gaps" in p else ""
        ax.annotate(f"{p['gap']:+.2%} ({p['verdict']}{seeds})", (xi, yi), textcoords="offset points",
                    xytext=(6, 6), fontsize=8)
    if sets:  # each seed pair's own gap, beside its set's mean
        ax.scatter([xi * 0.96 for xi, p in zip(x, pts) for _ in p["pair_gaps"]],
                   [100 * g for p in pts for g in p["pair_gaps"]], s=14, color="tab:red", alpha=0.45,
                   label="each seed pair's gap")
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:olive"]
    series: dict[str, list[dict]] = {}
    for v in variants:  # other recipes or seeds: one series per label (joined), else one marker per report
        series.setdefault(v["label"] or _name(v), []).append(v)
    for i, (label, vs) in enumerate(series.items()):
        c = colors[i % len(colors)]
        # nudged sideways (x1.04 per series, log axis) so points at one size do not hide each other's bars
        xv = [v["params"] / 1e6 * 1.04 ** (i + 1) for v in vs]
        yv = [100 * v["gap"] for v in vs]
        seed_sets = all("pair_gaps" in v for v in vs)
        ax.errorbar(xv, yv, yerr=_yerr(vs), fmt="s--" if len(vs) > 1 else "s", capsize=4, color=c, alpha=0.8,
                    label=f"{label}: mean paired gap over seeds, 95% t interval" if seed_sets
                    else f"{label}, 95% CI")
        for x, y, v in zip(xv, yv, vs):
            note = f" ({v['verdict']}, {len(v['pair_gaps'])} seeds)" if "pair_gaps" in v else ""
            ax.annotate(f"{v['gap']:+.2%}{note}", (x, y), textcoords="offset points", xytext=(6, -10), fontsize=7,
                        color=c)
            if "pair_gaps" in v:
                ax.scatter([x * 1.02] * len(v["pair_gaps"]), [100 * g for g in v["pair_gaps"]], s=10, color=c,
                           alpha=0.45)
    ax.axhline(100 * threshold, color="gray", ls="--", label=f"acceptance threshold {threshold:.0%}")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.set(xlabel="parameters (millions, log scale)", ylabel="final validation-loss gap (%)",
           title=f"Gap vs model size ({pts[0]['steps']:,} steps each, CPU, 2 ranks)")
    # below the axes: inside it hid points (the series span -7% .. +8%)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="report directories of `ds-nvfp4 compare --out`")
    ap.add_argument("--variant", action="append", default=[], metavar="DIR[=LABEL]",
                    help="a report of another recipe or seed, drawn apart from the default preset's line; reports "
                         "with one LABEL form one series")
    ap.add_argument("--out", default="gap_vs_size.png")
    ap.add_argument("--json", help="also write the points here")
    args = ap.parse_args()
    pts, variants = points(args.reports), points(args.variant)
    print("| candidate | parameters | steps | tokens | final gap | 95% CI | verdict |")
    print("|---|---|---|---|---|---|---|")
    for p in pts + variants:
        print(f"| {_name(p)} | {p['params']:,} | {p['steps']:,} | {p['tokens']:,} | {p['gap']:+.3%} | "
              f"[{p['ci'][0]:+.3%}, {p['ci'][1]:+.3%}] | {p['verdict']} |")
    plot(pts, Path(args.out), variants=variants)
    if args.json:
        Path(args.json).write_text(json.dumps({"default": pts, "variants": variants}, indent=2) + "\n")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
