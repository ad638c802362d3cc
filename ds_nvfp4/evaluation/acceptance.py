"""The BF16-vs-NVFP4 acceptance report: align two runs by step, judge each criterion with its uncertainty.

Verdicts never pass or fail on noise: a criterion is ``pass`` when the whole confidence interval of its gap is
within the threshold, ``fail`` when the whole interval is beyond it, and ``inconclusive`` otherwise. The final
validation-loss gap's interval is a paired bootstrap over the final evaluation's batches (both runs evaluate the
same held-out windows); the downstream accuracy gap comes from ``ds-nvfp4 finetune`` results when present.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .run_files import read_json, read_rows, run_file

#: fewest paired fine-tune seeds the downstream criterion judges on
MIN_SEEDS = 4


class CompareError(ValueError):
    """The two runs cannot be compared (different data, seed, steps or model): exit status 2."""


@dataclass
class Criterion:
    name: str
    value: float | None          # the measured gap
    ci: tuple[float, float] | None
    threshold: float
    verdict: str                 # pass | fail | inconclusive | not measured
    unit: str = ""
    note: str = ""
    #: whether the verdict counts in the report's verdict (False: shown as supporting evidence only)
    counts: bool = True


@dataclass
class Report:
    baseline: str
    candidate: str
    criteria: list[Criterion] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    ratios: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: what the report's tables and plot call the two runs: their precision, and their seed when that is the same
    labels: tuple[str, str] = ("BF16", "NVFP4")
    #: where the two ran, by their config.json "machine": "same machine", "different machines" or "machine not
    #: recorded"; the speed ratio compares recipes only on one machine
    machines: str = "same machine"

    @property
    def verdict(self) -> str:
        measured = [c.verdict for c in self.criteria if c.verdict != "not measured" and c.counts]
        if "fail" in measured:
            return "fail"
        if "inconclusive" in measured or not measured:
            return "inconclusive"
        return "pass"

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": 1, "inconclusive": 3}[self.verdict]


def _load(run: Path) -> tuple[dict, list[dict], dict]:
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        if run_file(run, name) is None:
            raise CompareError(f"{run / name}: missing (is {run} a finished launch/train.py run directory?)")
    return read_json(run, "config.json"), read_rows(run), read_json(run, "summary.json")


def _check_comparable(a: dict, b: dict, sa: dict, sb: dict, seeds_may_differ: bool = False) -> None:
    checks = [("data", a["data"].get("sha256_train"), b["data"].get("sha256_train")),
              ("validation data", a["data"].get("sha256_val"), b["data"].get("sha256_val")),
              ("--seed", a["args"]["seed"], b["args"]["seed"]),
              ("--steps", a["args"]["steps"], b["args"]["steps"]),
              ("model", a["model"], b["model"]), ("--seq", a["args"]["seq"], b["args"]["seq"]),
              ("--eval-batches", a["args"]["eval_batches"], b["args"]["eval_batches"]),
              ("steps run", sa["steps"], sb["steps"])]
    for what, x, y in checks:
        if x != y and not (what == "--seed" and seeds_may_differ):
            hint = (" (--seeds-may-differ compares them anyway: the noise floor of one run per recipe)"
                    if what == "--seed" else "")
            raise CompareError(f"the runs differ in {what} ({x!r} vs {y!r}): a loss gap would not measure "
                               f"precision{hint}")


def machine_name(m: dict | None) -> str:
    """One config.json ``machine`` entry as "CPU model (BF16 GEMM units)", or "not recorded"."""
    return f"{m.get('name', '?')} ({m.get('bf16_gemm', '?')})" if m else "not recorded"


def _machines(a: dict | None, b: dict | None) -> tuple[str, str | None]:
    """Where the runs ran, by their config.json "machine" (device, name, BF16 GEMM units): the label of the speed
    ratio ("same machine", "different machines", "machine not recorded") and a note when the two differ or one is
    not recorded, since GEMM kernels that round differently keep even one recipe from giving the same bits."""
    if a is None and b is None:
        return "machine not recorded", None
    if a == b:
        return "same machine", None
    why = ("so the two trajectories part from the first step even for one recipe, and the gap includes that "
           "perturbation, which the interval (over held-out batches) does not cover")
    if a is None or b is None:
        which = "baseline" if a is None else "candidate"
        return "machine not recorded", (
            f"the {which} run does not record its machine (made before launch/train.py recorded it): if the two "
            f"ran on different CPUs or GPUs, their BF16 GEMM kernels differ, {why}")
    desc = [f"{m.get('name')} ({m.get('device')}, BF16 GEMMs: {m.get('bf16_gemm')})" for m in (a, b)]
    return "different machines", (f"the runs ran on different machines (baseline {desc[0]}, candidate {desc[1]}): "
                                  f"their BF16 GEMM kernels differ, {why}")


def _labels(a: dict, b: dict) -> tuple[str, str]:
    """"BF16"/"NVFP4" by each run's precision section; two runs of one precision are told apart by their seed."""
    la, lb = ("NVFP4" if (c.get("precision") or {}).get("enabled") else "BF16" for c in (a, b))
    if la == lb:
        return f"{la} seed {a['args']['seed']}", f"{lb} seed {b['args']['seed']}"
    return la, lb


def paired_bootstrap(base: list[float], cand: list[float], stat, n: int = 2000, seed: int = 0) -> tuple[float, ...]:
    """95% percentile interval of ``stat(base_sample, cand_sample)`` over paired resamples."""
    x, y = np.asarray(base), np.asarray(cand)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n, len(x)))
    vals = np.array([stat(x[i], y[i]) for i in idx])
    return float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))


def _verdict(ci: tuple[float, float], threshold: float) -> str:
    if ci[1] <= threshold:
        return "pass"
    if ci[0] > threshold:
        return "fail"
    return "inconclusive"


def compare(baseline: str | Path, candidate: str | Path, loss_gap: float = 0.01, acc_gap: float = 0.5,
            seeds_may_differ: bool = False) -> Report:
    """Build the report (raises CompareError for runs that cannot be compared).

    ``seeds_may_differ``: accept runs trained with different ``--seed`` (initialization and batch order; the
    validation windows are the same for every seed). Two runs of one recipe then measure the run-to-run noise that a
    single-run verdict carries; the report says so."""
    base, cand = Path(baseline), Path(candidate)
    ca, ra, sa = _load(base)
    cb, rb, sb = _load(cand)
    _check_comparable(ca, cb, sa, sb, seeds_may_differ)
    rep = Report(str(base), str(cand), labels=_labels(ca, cb))
    if ca["args"]["seed"] != cb["args"]["seed"]:
        rep.notes.append(f"the runs differ in --seed ({ca['args']['seed']} vs {cb['args']['seed']}): the gap includes "
                         "the run-to-run noise of initialization and batch order, which the interval (over held-out "
                         "batches) does not cover")
    rep.machines, machine_note = _machines(ca.get("machine"), cb.get("machine"))
    if machine_note:
        rep.notes.append(machine_note)
    for who, c in (("baseline", ca), ("candidate", cb)):
        parts = c.get("machines") or []
        if len(parts) > 1:  # resumed on another type (launch/train.py --allow-machine-change)
            rep.machines = "different machines"
            rep.notes.append(f"the {who} run changed machine type when it was resumed ("
                             + "; ".join(f"from step {q['from_step']}: {machine_name(q['machine'])}" for q in parts)
                             + "): its trajectory mixes two types' bits, so it is not a same-machine run")
    ea = {r["step"]: r for r in ra if "val_loss" in r}
    eb = {r["step"]: r for r in rb if "val_loss" in r}
    for step in sorted(set(ea) & set(eb)):
        va, vb = ea[step]["val_loss"], eb[step]["val_loss"]
        rep.evals.append({"step": step, "baseline_val_loss": va, "candidate_val_loss": vb,
                          "baseline_val_ppl": math.exp(va), "candidate_val_ppl": math.exp(vb),
                          "relative_gap": (vb - va) / va})
    if not rep.evals:
        raise CompareError("the runs have no evaluation at a common step")
    last = max(set(ea) & set(eb))
    la, lb = ea[last]["val_batch_losses"], eb[last]["val_batch_losses"]

    def rel(x: np.ndarray, y: np.ndarray) -> float:  # the candidate's relative excess loss
        return (y.mean() - x.mean()) / x.mean()

    source = "the training's last evaluation"
    final = _final_evals(base, cand, sa["steps"], rep.notes)
    if final is not None:
        # the training's own verdict stays on record beside the re-evaluation that replaces it
        ci = paired_bootstrap(la, lb, rel)
        source = (f"final_eval.json: the last checkpoint re-evaluated; the training's last evaluation, {len(la)} "
                  f"batches: {100 * rel(np.asarray(la), np.asarray(lb)):+.3f}% CI [{100 * ci[0]:+.3f}%, "
                  f"{100 * ci[1]:+.3f}%] -> {_verdict(ci, loss_gap)}")
        last, la, lb = final
    gap = (np.mean(lb) - np.mean(la)) / np.mean(la)
    ci = paired_bootstrap(la, lb, rel)
    note = f"step {last}, {len(la)} held-out batches ({source}), paired bootstrap 95% CI"
    verdict = _verdict(ci, loss_gap)
    if verdict == "inconclusive":
        note += f"; {_batches_needed(gap, ci, loss_gap, len(la), ca)}"
    rep.criteria.append(Criterion("final validation-loss gap", float(gap), ci, loss_gap, verdict, "relative", note))
    probe = _probe(base, cand, acc_gap)
    finetuned = _downstream(base, cand, acc_gap)
    if probe.verdict != "not measured":  # deterministic: it decides; the seed-noisy fine-tunes support it
        finetuned.counts = False
        finetuned.note += "; supporting evidence only (the linear probe decides the downstream verdict)"
        rep.criteria.append(probe)
    rep.criteria.append(finetuned)
    rep.ratios = {
        "tokens_per_s": sb["tokens_per_s_median"] / sa["tokens_per_s_median"],
        "weight_bytes_per_rank": sb["weight_bytes_per_rank"] / sa["weight_bytes_per_rank"],
        "peak_rss_per_rank": max(sb["peak_rss_bytes_per_rank"]) / max(sa["peak_rss_bytes_per_rank"]),
    }
    rep.notes.append(f"candidate kernel: {cb.get('kernel')}; baseline kernel: {ca.get('kernel') or 'BF16 (none)'}")
    if "fp4_gemm_share" in sb:
        sched = sb.get("precision_schedule") or {}
        moves = ", ".join(f"{t['phase']} from step {t['step']}" for t in sched.get("transitions", [])[1:])
        rep.notes.append(f"candidate: {sb['fp4_gemm_share']:.1%} of the Linear GEMM FLOPs ran in FP4"
                         + (f" (precision.schedule: {moves})" if moves else ""))
        guard = sched.get("spike_guard")
        if guard is not None:
            eps = "; ".join(f"step {e['detected_at']} loss {e['loss']:.4g} = {e['loss'] / e['median']:.2f}x the "
                            f"median: steps {e['start']}-{e['end']} BF16" for e in guard["episodes"])
            late = f"; spikes past the budget at steps {guard['ignored']}" if guard["ignored"] else ""
            rep.notes.append(f"candidate: spike guard: {len(guard['episodes'])} episode(s)"
                             + (f" ({eps})" if eps else "") + late)
    if last < 1000:
        rep.notes.append("short run: early in training BF16 and NVFP4 curves coincide per step, so a small gap here "
                         "says little about late-training gaps; judge long runs (30M-100M models) on GPUs")
    return rep


def unpack_correct(text: str, n: int) -> np.ndarray:
    """Per-example correctness written by ``ds_nvfp4.evaluation.finetune.pack_correct``: bool ``[n]``."""
    return np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))[:n].astype(bool)


def two_level_bootstrap(base: np.ndarray, cand: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the accuracy gap (points, baseline minus candidate) from per-example correctness.

    ``base``/``cand``: bool ``[seeds, examples]``, row s of both fine-tuned with seed s on the same test examples.
    Each resample draws seeds with replacement AND test examples with replacement (the same examples for both runs),
    so the interval covers both the fine-tuning noise between seeds and the finite test set.
    """
    d = base.astype(np.int8) - cand.astype(np.int8)
    rng = np.random.default_rng(seed)
    s, m = d.shape
    vals = np.empty(n)
    for r in range(n):
        rows = rng.integers(0, s, s)
        cols = rng.integers(0, m, m)
        vals[r] = d[rows][:, cols].mean()
    return float(100 * np.percentile(vals, 2.5)), float(100 * np.percentile(vals, 97.5))


def _downstream(base: Path, cand: Path, threshold: float) -> Criterion:
    fa, fb = base / "finetune.json", cand / "finetune.json"
    if not (fa.exists() and fb.exists()):
        return Criterion("downstream accuracy gap", None, None, threshold, "not measured", "points",
                         "run `ds-nvfp4 finetune RUN_DIR` on both runs")
    a, b = json.loads(fa.read_text()), json.loads(fb.read_text())
    for key in ("task", "seeds", "steps", "batch", "lr", "test_examples", "test_sha256"):
        if a.get(key) != b.get(key):
            raise CompareError(f"finetune results differ in {key} ({fa}: {a.get(key)!r}, {fb}: {b.get(key)!r}): "
                               "fine-tune both runs with the same command")
    diffs = [100 * (x - y) for x, y in zip(a["accuracy"], b["accuracy"])]  # baseline minus candidate, points
    gap = float(np.mean(diffs))
    if "correct" in a and "correct" in b:
        n = a["test_examples"]
        ca = np.stack([unpack_correct(t, n) for t in a["correct"]])
        cb = np.stack([unpack_correct(t, n) for t in b["correct"]])
        gap = float(100 * (ca.mean() - cb.mean()))  # exact, where the stored accuracies are rounded floats
        ci = two_level_bootstrap(ca, cb)
        how = f"two-level paired bootstrap over seeds and {n} test examples"
    else:  # results written before per-example correctness was recorded
        ci = paired_bootstrap(a["accuracy"], b["accuracy"], lambda x, y: 100 * (x.mean() - y.mean()))
        how = "paired bootstrap over seeds only (no per-example results recorded)"
    note = f"{a['task']}, {len(diffs)} seeds, {how}, 95% CI (baseline minus candidate)"
    verdict = _verdict(ci, threshold)
    if len(diffs) < MIN_SEEDS:  # a bootstrap over 2-3 pairs has a handful of distinct resamples: no verdict
        verdict = "inconclusive"
        note += f"; fewer than {MIN_SEEDS} seeds, so no verdict"
    return Criterion("downstream accuracy gap", gap, ci, threshold, verdict, "points", note)


def _probe(base: Path, cand: Path, threshold: float) -> Criterion:
    """The linear probe's accuracy gap (``ds-nvfp4 probe`` on both runs): paired bootstrap over the examples."""
    from .linear_probe import SETTINGS

    pa, pb = base / "probe.json", cand / "probe.json"
    name = "downstream accuracy gap (linear probe)"
    if not (pa.exists() and pb.exists()):
        return Criterion(name, None, None, threshold, "not measured", "points", "run `ds-nvfp4 probe RUN_DIR` on both "
                                                                              "runs")
    a, b = json.loads(pa.read_text()), json.loads(pb.read_text())
    for key in SETTINGS:
        if a.get(key) != b.get(key):
            raise CompareError(f"probe results differ in {key} ({pa}: {a.get(key)!r}, {pb}: {b.get(key)!r}): probe "
                               "both runs with the same command")
    n = a["examples"]
    ca, cb = unpack_correct(a["correct"], n)[None], unpack_correct(b["correct"], n)[None]
    gap = float(100 * (ca.mean() - cb.mean()))
    ci = two_level_bootstrap(ca, cb)  # one row: a paired bootstrap over examples only (the probe has no seeds)
    disagree = float((ca != cb).mean())
    verdict = _verdict(ci, threshold)
    note = (f"{a['task']}, {n} examples {a['folds']}-fold cross-fitted, paired bootstrap over examples, 95% CI "
            f"(baseline minus candidate); the probes disagree on {disagree:.1%} of the examples")
    if verdict == "inconclusive":
        note += f"; {examples_needed(gap, ci, threshold, n)}"
    return Criterion(name, gap, ci, threshold, verdict, "points", note)


def _needed(gap: float, ci: tuple[float, float], threshold: float, n: int) -> int | None:
    """Samples an inconclusive paired interval would need: the half-width shrinks as 1/sqrt(samples), so deciding
    ``gap`` against ``threshold`` takes ~``n (half-width / |threshold - gap|)^2`` at the same gap (None: the gap
    sits on the threshold, no number decides it)."""
    half, room = (ci[1] - ci[0]) / 2, abs(threshold - gap)
    return None if room < 1e-9 else math.ceil(n * (half / room) ** 2)


def examples_needed(gap: float, ci: tuple[float, float], threshold: float, n: int) -> str:
    """:func:`_needed` for the probe's examples (gap and threshold in accuracy points)."""
    needed = _needed(gap, ci, threshold, n)
    if needed is None:
        return "the gap sits on the threshold: no number of examples decides it"
    return (f"at this gap a verdict needs a half-width under {abs(threshold - gap):.2f} points, i.e. ~{needed:,} "
            f"examples (now {n:,}, half-width {(ci[1] - ci[0]) / 2:.2f})")


def _batches_needed(gap: float, ci: tuple[float, float], threshold: float, n: int, config: dict) -> str:
    """:func:`_needed` for the final loss gap's held-out batches, against what the validation split holds."""
    needed = _needed(gap, ci, threshold, n)
    if needed is None:
        return "the gap sits on the threshold: no number of held-out batches decides it"
    micro = config.get("ds_config", {}).get("train_micro_batch_size_per_gpu")
    seq, val = config["args"].get("seq"), config["data"].get("val_bytes")
    split = f"; the validation split holds ~{val // (micro * seq):,}" if micro and seq and val else ""
    return (f"at this gap a verdict needs ~{needed:,} held-out batches (now {n:,}{split}): `launch/train.py ... "
            f"--final-eval --eval-batches N` on both runs writes final_eval.json, which compare then judges")


def _final_evals(base: Path, cand: Path, steps: int,
                 notes: list[str]) -> tuple[int, list[float], list[float]] | None:
    """(step, baseline batch losses, candidate batch losses) from both runs' ``final_eval.json`` (launch/train.py
    --final-eval), or None when neither has one. Raises CompareError when the two evaluations differ in their
    windows (batches, micro-batch, sequence) or in the step evaluated, or one is not of the run's last step."""
    paths = [base / "final_eval.json", cand / "final_eval.json"]
    present = [p.exists() for p in paths]
    if not any(present):
        return None
    if not all(present):
        have, lack = (paths[0], paths[1]) if present[0] else (paths[1], paths[0])
        notes.append(f"{have} exists but {lack} does not: the final gap uses both runs' last training evaluation "
                     f"(run launch/train.py --final-eval with the same --eval-batches on {lack.parent})")
        return None
    fa, fb = (json.loads(p.read_text()) for p in paths)
    for key in ("step", "eval_batches", "micro_batch", "seq"):
        if fa.get(key) != fb.get(key):
            raise CompareError(f"{paths[0]} and {paths[1]} differ in {key} ({fa.get(key)!r} vs {fb.get(key)!r}): "
                               "re-evaluate both runs with the same --final-eval --eval-batches")
    if fa["step"] != steps:
        raise CompareError(f"{paths[0]} and {paths[1]} evaluate step {fa['step']}, the runs end at step {steps}: "
                           "their newest checkpoint is not the final one (ckpt/latest)")
    return fa["step"], fa["val_batch_losses"], fb["val_batch_losses"]


def write(rep: Report, out_dir: str | Path) -> dict[str, Path]:
    """report.md, report.json and report.png (loss curves and the relative gap) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "report.md", "json": out / "report.json", "png": out / "report.png"}
    data = {"verdict": rep.verdict, "exit_code": rep.exit_code, "baseline": rep.baseline,
            "candidate": rep.candidate, "criteria": [c.__dict__ for c in rep.criteria], "evals": rep.evals,
            "ratios": rep.ratios, "notes": rep.notes}
    paths["json"].write_text(json.dumps(data, indent=2))
    _plot(rep, paths["png"])
    la, lb = rep.labels
    lines = [f"# NVFP4 acceptance report: **{rep.verdict.upper()}**", "",
             f"- baseline: `{rep.baseline}`", f"- candidate: `{rep.candidate}`", "",
             "| criterion | gap | 95% CI | threshold | verdict |", "|---|---|---|---|---|"]
    for c in rep.criteria:
        def fmt(v: float, c: Criterion = c) -> str:
            return f"{v:+.3%}" if c.unit == "relative" else f"{v:+.2f} {c.unit}"

        gap = fmt(c.value) if c.value is not None else "-"
        ci = f"[{fmt(c.ci[0])}, {fmt(c.ci[1])}]" if c.ci else "-"
        thr = f"{c.threshold:.1%}" if c.unit == "relative" else f"{c.threshold} {c.unit}"
        lines.append(f"| {c.name} | {gap} | {ci} | <= {thr} | {c.verdict}{'' if c.counts else ' (supporting)'} |")
    lines += ["", f"| eval step | {la} val loss | {lb} val loss | {la} ppl | {lb} ppl | relative gap |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {e['step']} | {e['baseline_val_loss']:.4f} | {e['candidate_val_loss']:.4f} | "
              f"{e['baseline_val_ppl']:.3f} | {e['candidate_val_ppl']:.3f} | {e['relative_gap']:+.3%} |"
              for e in rep.evals]
    lines += ["", f"| ratio ({lb} / {la}, {rep.machines}) | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in rep.ratios.items() if v is not None]
    lines += ["", *[f"- {c.name}: {c.note}" for c in rep.criteria], *[f"- {n}" for n in rep.notes], "",
              "![loss curves](report.png)"]
    paths["md"].write_text("\n".join(lines) + "\n")
    return paths


def _plot(rep: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base_rows, cand_rows = read_rows(Path(rep.baseline)), read_rows(Path(rep.candidate))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for rows, label, color in ((base_rows, rep.labels[0], "tab:blue"), (cand_rows, rep.labels[1], "tab:red")):
        steps = [r["step"] for r in rows]
        loss = np.asarray([r["loss"] for r in rows])
        k = max(1, len(loss) // 40)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax1.plot(steps[k - 1:], smooth, color=color, alpha=0.45, lw=1, label=f"{label} train (smoothed)")
        ev = [r for r in rows if "val_loss" in r]
        ax1.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", color=color, label=f"{label} validation")
    ax1.set(xlabel="step", ylabel="loss (nats/byte)", title="Loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    steps = [e["step"] for e in rep.evals]
    ax2.plot(steps, [100 * e["relative_gap"] for e in rep.evals], "o-", color="tab:purple")
    thr = next((c.threshold for c in rep.criteria if c.unit == "relative"), 0.01)
    ax2.axhline(100 * thr, color="gray", ls="--", label=f"threshold {thr:.0%}")
    ax2.axhline(0, color="black", lw=0.8)
    crit = rep.criteria[0]
    if crit.ci:
        ax2.errorbar([steps[-1]], [100 * crit.value], yerr=[[100 * (crit.value - crit.ci[0])],
                                                            [100 * (crit.ci[1] - crit.value)]],
                     fmt="s", color="black", capsize=4, label="final gap, 95% CI")
    ax2.set(xlabel="step", ylabel=f"{rep.labels[1]} vs {rep.labels[0]} validation loss (%)",
            title=f"Relative gap: {rep.verdict}")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
