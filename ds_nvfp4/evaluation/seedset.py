"""Seed sets judged together: several BF16 runs and several NVFP4 runs, paired by seed.

One pair of runs gives a gap whose interval covers only which held-out batches were drawn; two runs of one recipe
that differ in their seed end further apart than that (docs/results.md). So a claim rests on the mean of the paired
gaps over seeds (each pair: the same initialization and batch order, BF16 against NVFP4) and its 95% t interval
across seeds. The rule (docs/training.md, fixed before the runs):

* **pass** when the interval's upper bound is within the threshold (1%),
* **fail** when its lower bound is beyond it,
* **inconclusive** otherwise, with how many seeds would decide it at the observed mean and spread.

Every run of a set must share data, model, steps, sequence, protocol (``config.json`` "protocol", deviations
included) and final evaluation; each pair is judged by :func:`ds_nvfp4.evaluation.acceptance.compare` (whose
``final_eval.json`` whole-split evaluation it then uses), and the report adds the BF16 runs' own seed spread.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .acceptance import CompareError, compare, machine_name
from .run_files import read_rows

#: two-sided 95% quantiles of Student's t, df = 1 .. 30 (beyond: 1.96 + 2.4/df, within 0.002 of the exact value)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("a t interval needs at least two seeds")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the 95% t interval of the mean of ``values`` (>= 2 of them)."""
    if len(values) < 2:
        raise ValueError("a t interval needs at least two seeds")
    x = np.asarray(values, dtype=float)
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    half = t975(len(x) - 1) * sd / math.sqrt(len(x))
    return mean, mean - half, mean + half


def seeds_needed(mean: float, sd: float, threshold: float, have: int, limit: int = 200) -> int | None:
    """Seeds a t interval at this mean and spread needs to leave the threshold (None: none up to ``limit``, the
    mean sits on it)."""
    room = abs(threshold - mean)
    for n in range(max(have, 2), limit + 1):
        if t975(n - 1) * sd / math.sqrt(n) < room:
            return n
    return None


@dataclass
class Pair:
    seed: int
    baseline: str
    candidate: str
    baseline_loss: float
    candidate_loss: float
    gap: float                          #: relative gap of this pair (candidate over baseline)
    ci: tuple[float, float]             #: its held-out-batch bootstrap interval
    verdict: str                        #: this pair alone
    batches: int                        #: held-out batches it was judged on
    source: str                         #: "final_eval.json (whole split)" or the training's last evaluation
    machine: str = ""                   #: where the pair ran (config.json "machine"), "A / B" when its runs differ


@dataclass
class SeedSetReport:
    pairs: list[Pair]
    threshold: float
    mean: float = 0.0
    sd: float = 0.0
    ci: tuple[float, float] = (0.0, 0.0)
    verdict: str = "inconclusive"
    seeds_needed: int | None = None
    bf16_spread: float = 0.0            #: (max - min) / min of the baseline runs' final losses
    bf16_sd: float = 0.0                #: their relative standard deviation
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": 1, "inconclusive": 3}[self.verdict]

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def _config(run: Path) -> dict:
    path = run / "config.json"
    if not path.exists():
        raise CompareError(f"{path}: missing (is {run} a finished launch/train.py run directory?)")
    return json.loads(path.read_text())


def _by_seed(runs: list[str], role: str) -> dict[int, Path]:
    out: dict[int, Path] = {}
    for r in map(Path, runs):
        seed = _config(r)["args"]["seed"]
        if seed in out:
            raise CompareError(f"{role} runs {out[seed]} and {r} both have --seed {seed}: one run per seed and "
                               "precision")
        out[seed] = r
    return out


def _precision(config: dict) -> dict | None:
    """A run's recorded precision section with the fields added to the schema since the run filled in with their
    defaults (``precision.base`` arrived after runs of a set had been kept: absent there, the default in newer
    runs, the same training). A section the current schema rejects is compared as recorded."""
    from ..config.schema import PrecisionConfig

    recorded = config.get("precision")
    if recorded is None:
        return None
    try:
        return PrecisionConfig.model_validate(recorded).model_dump(mode="json")
    except ValueError:
        return recorded


def _same(runs: list[Path], what: str, get) -> None:
    """Every run agrees on ``get(config)``, or CompareError naming the first that does not."""
    first = get(_config(runs[0]))
    for r in runs[1:]:
        value = get(_config(r))
        if value != first:
            raise CompareError(f"{runs[0]} and {r} differ in {what} ({first!r} vs {value!r}): a seed set must share "
                               "everything but the seed and the precision")


def compare_seed_sets(baselines: list[str], candidates: list[str], loss_gap: float = 0.01) -> SeedSetReport:
    """Pair ``baselines`` and ``candidates`` by seed and judge the mean paired gap (module docstring). Raises
    CompareError for sets that cannot be compared (unpaired seeds, differing protocols, fewer than two pairs)."""
    base, cand = _by_seed(baselines, "baseline"), _by_seed(candidates, "candidate")
    if set(base) != set(cand):
        raise CompareError(f"seeds {sorted(set(base) ^ set(cand))} have no partner: baseline seeds {sorted(base)}, "
                           f"candidate seeds {sorted(cand)}")
    if len(base) < 2:
        raise CompareError("a seed set needs at least two seeds (one pair: `ds-nvfp4 compare BASELINE CANDIDATE`)")
    every = [*base.values(), *cand.values()]
    _same(every, "protocol", lambda c: c.get("protocol"))
    _same(every, "the fixed final evaluation", lambda c: c.get("final_eval"))
    _same(every, "model", lambda c: c["model"])
    _same(every, "--steps", lambda c: c["args"]["steps"])
    _same(list(base.values()), "precision", _precision)
    _same(list(cand.values()), "precision", _precision)
    pairs, notes = [], []
    for seed in sorted(base):
        rep = compare(base[seed], cand[seed], loss_gap)
        crit = rep.criteria[0]
        final = (base[seed] / "final_eval.json").exists() and (cand[seed] / "final_eval.json").exists()
        fe = json.loads((base[seed] / "final_eval.json").read_text()) if final else None
        losses = (_final_loss(base[seed]), _final_loss(cand[seed]))
        pairs.append(Pair(seed, str(base[seed]), str(cand[seed]), *losses, float(crit.value), crit.ci,
                          crit.verdict, len(fe["val_batch_losses"]) if fe else 0,
                          ("final_eval.json" + (" (whole split)" if fe.get("whole_split") else "")) if fe
                          else "the training's last evaluation",
                          " / ".join(dict.fromkeys(machine_label(_config(r)) for r in (base[seed], cand[seed])))))
        notes += [f"seed {seed}: {n}" for n in rep.notes if "differ" in n or "machine" in n]
    protocol = _config(every[0]).get("protocol")
    if protocol is None:
        notes.append("the runs follow no reference protocol (launch/train.py --protocol): the evaluation the claim "
                     "rests on was not fixed in config.json before they ran")
    elif protocol.get("final_eval") and not all(p.source.endswith("(whole split)") for p in pairs):
        raise CompareError("the runs' protocol fixes a whole-split final evaluation, but some pair lacks it "
                           f"({[p.seed for p in pairs if not p.source.endswith('(whole split)')]}): rerun "
                           "launch/train.py --protocol ... --final-eval --eval-batches all on them")
    kinds = sorted({p.machine for p in pairs})
    if len(kinds) > 1:  # each pair's gap is a same-machine difference; the BF16 runs' spread is not
        notes.append(f"the pairs ran on {len(kinds)} machine types ({'; '.join(kinds)}): each pair's gap compares "
                     "runs of one machine, but the BF16 seed spread mixes machines (their GEMM kernels round "
                     "differently)")
    gaps = [p.gap for p in pairs]
    mean, low, high = t_interval(gaps)
    sd = float(np.std(gaps, ddof=1))
    verdict = "pass" if high <= loss_gap else ("fail" if low > loss_gap else "inconclusive")
    bl = np.asarray([p.baseline_loss for p in pairs])
    report = SeedSetReport(pairs, loss_gap, mean, sd, (low, high), verdict,
                           seeds_needed(mean, sd, loss_gap, len(pairs)) if verdict == "inconclusive" else None,
                           float((bl.max() - bl.min()) / bl.min()), float(bl.std(ddof=1) / bl.mean()), notes)
    return report


def machine_label(config: dict) -> str:
    """A run's machine type as its config.json records it: "CPU model (BF16 GEMM units)", or "not recorded"; a run
    resumed on another type (launch/train.py --allow-machine-change: config.json "machines") names each part,
    "A, then B from step N", so that it never reads as a run of one type."""
    parts = config.get("machines") or []
    if len(parts) > 1:
        return machine_name(parts[0]["machine"]) + "".join(
            f", then {machine_name(p['machine'])} from step {p['from_step']}" for p in parts[1:])
    return machine_name(config.get("machine"))


def _final_loss(run: Path) -> float:
    """The run's final validation loss: final_eval.json when present, else its last evaluation."""
    fe = run / "final_eval.json"
    if fe.exists():
        return float(json.loads(fe.read_text())["val_loss"])
    return float([r for r in read_rows(run) if "val_loss" in r][-1]["val_loss"])


def write_seed_set(rep: SeedSetReport, out_dir: str | Path) -> dict[str, Path]:
    """report.md, report.json and report.png (each pair's gap with its interval, the mean with its t interval)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "report.md", "json": out / "report.json", "png": out / "report.png"}
    paths["json"].write_text(json.dumps({"verdict": rep.verdict, "exit_code": rep.exit_code, **rep.to_dict()},
                                        indent=2))
    lines = [f"# NVFP4 seed-set report: **{rep.verdict.upper()}**", "",
             f"Mean paired gap over {len(rep.pairs)} seeds: **{rep.mean:+.3%}**, 95% t interval "
             f"[{rep.ci[0]:+.3%}, {rep.ci[1]:+.3%}] (sd across seeds {rep.sd:.3%}); threshold {rep.threshold:.1%}: "
             "pass when the upper bound is within it, fail when the lower bound is beyond it."
             + (f" At this mean and spread ~{rep.seeds_needed} seeds would decide it."
                if rep.seeds_needed else ""), "",
             f"BF16 seed spread: {rep.bf16_spread:.3%} (max - min over min), relative sd {rep.bf16_sd:.3%}.", "",
             "| seed | BF16 val loss | NVFP4 val loss | gap | 95% CI (held-out batches) | pair alone | evaluated on "
             "| machine |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {p.seed} | {p.baseline_loss:.4f} | {p.candidate_loss:.4f} | {p.gap:+.3%} | "
              f"[{p.ci[0]:+.3%}, {p.ci[1]:+.3%}] | {p.verdict} | {p.source}, {p.batches or '-'} batches | "
              f"{p.machine} |"
              for p in rep.pairs]
    lines += ["", *[f"- {p.seed}: `{p.baseline}` vs `{p.candidate}`" for p in rep.pairs],
              *[f"- {n}" for n in rep.notes], "", "![paired gaps](report.png)"]
    paths["md"].write_text("\n".join(lines) + "\n")
    _plot(rep, paths["png"])
    return paths


def _plot(rep: SeedSetReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(len(rep.pairs)))
    ax.errorbar(xs, [100 * p.gap for p in rep.pairs],
                yerr=[[100 * (p.gap - p.ci[0]) for p in rep.pairs], [100 * (p.ci[1] - p.gap) for p in rep.pairs]],
                fmt="o", color="tab:red", capsize=4, label="pair gap, 95% CI over held-out batches")
    m = len(xs)
    ax.errorbar([m], [100 * rep.mean], yerr=[[100 * (rep.mean - rep.ci[0])], [100 * (rep.ci[1] - rep.mean)]],
                fmt="s", color="black", capsize=6, label="mean, 95% t interval across seeds")
    ax.axhline(100 * rep.threshold, color="gray", ls="--", label=f"threshold {rep.threshold:.0%}")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks([*xs, m], [f"seed {p.seed}" for p in rep.pairs] + ["mean"])
    ax.set(ylabel="NVFP4 vs BF16 final validation loss (%)", title=f"Seed set: {rep.verdict}")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
