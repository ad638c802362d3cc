"""`ds-nvfp4 explain FILE`: the effective precision settings and what each implies."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import ConfigError, PrecisionConfig, UnreadableConfig, load_config
from ..config.schedule import SchedulePlan
from ..zero.traffic import NVFP4_BYTES_PER_PARAM


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="show the effective precision settings (defaults filled in) and their effect")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--model", help="also state the ZeRO-3 bytes per step of this model: a reference preset (20m, "
                                   "...) or a Hugging Face model directory / config.json (read on the meta device)")
    p.set_defaults(func=run)


def describe(ds: dict, pc: PrecisionConfig) -> list[str]:
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    lines = ["effective precision section:", *("  " + ln for ln in json.dumps(pc.model_dump(), indent=2).splitlines())]
    if not pc.enabled:
        return [*lines, "NVFP4 is disabled: ds_nvfp4.initialize is exactly deepspeed.initialize."]
    fp4 = "Fprop" if pc.backward.gemm == "bf16" else "Fprop, Dgrad and Wgrad"
    bf16_gemms = "Dgrad and Wgrad in BF16 with the same dequantized weight" if pc.backward.gemm == "bf16" else (
        "none of the Linear GEMMs; gradients " + ("stochastically rounded" if pc.backward.stochastic_rounding
                                                 else "rounded to nearest")
        + (", Wgrad operands Hadamard-transformed" if pc.backward.hadamard else ""))
    lines += [
        "what it means:",
        f"  FP4 GEMMs: {fp4} of the converted Linear layers; BF16: {bf16_gemms}.",
        "  Always BF16: attention BMMs, softmax, norms, embeddings, the LM head and every excluded layer.",
        "  Converted: nn.Linear, GPT-2 Conv1D and MoE experts (found by what they are: parameters holding several "
        "experts' matrices, lists of per-expert modules; routers, found by their role, stay BF16) whose names "
        f"match {pc.modules.include} minus {pc.modules.exclude}" + _block_rules(pc) + " (`--model` lists them).",
        *(f"  modules.overrides[{i}]: {r.match!r} -> {r.precision} (checked first, in this order)"
          for i, r in enumerate(pc.modules.overrides)),
        f"  Weights quantized with {pc.weights.block} blocks; activations 1x16 with a per-tensor dynamic amax"
        + (", RHT on both forward operands." if pc.activations.hadamard else "."),
    ]
    base = pc.base
    if pc.stored_packed(stage):
        bpp = NVFP4_BYTES_PER_PARAM[pc.weights.block]
        how = ("frozen: packed once, never re-quantized, no FP32 master or optimizer state" if base.frozen else
               "re-quantized from the FP32 master after each step")
        lines.append(f"  ZeRO-3 partitions of converted weights stored packed: {bpp:.4f} bytes/param "
                     f"({bpp / 2:.1%} of BF16's 2), {how} ({pc.describe_storage(stage)}).")
    else:
        lines.append(f"  Weights stored by DeepSpeed in BF16 (2 bytes/param; {pc.describe_storage(stage)}); FP4 GEMMs "
                     "quantize them on the fly.")
    lines.append(f"  All-gather: {pc.communication.all_gather}"
                 + (" (packed bytes + scales: 0.28x the BF16 traffic, identical gathered weights)"
                    if pc.communication.all_gather == "nvfp4" else " (dequantized just before the gather)")
                 + f"; reduce-scatter and gradients: {pc.communication.reduce_scatter}.")
    lines.append("  GEMM backend: " + (f"{pc.kernel} (an error at start-up if it cannot run here)" if pc.kernel
                                       else "best available, chosen and logged at start-up (`ds-nvfp4 env` shows it)"))
    if pc.monitor.enabled:
        lines.append(f"  Quantization statistics every {pc.monitor.interval} steps under Train/Precision/<layer>/...")
    nf = pc.nonfinite
    lines.append("  NaN/Inf gradients: " + (
        "the step raises ds_nvfp4.NonFiniteError on every rank, naming the step and the first FP4 layers that saw "
        "non-finite values; masters unchanged" if nf.action == "raise" else
        f"the step is skipped (DeepSpeed's skip), counted in engine.ds_nvfp4.skipped_steps and logged; more than "
        f"{nf.max_consecutive_skips} in a row raise ds_nvfp4.NonFiniteError"))
    if not (pc.modules.keep_first_blocks_bf16 or pc.modules.keep_last_blocks_bf16
            or pc.modules.keep_last_fraction_bf16):
        lines.append("  Every transformer block is FP4: the shipped presets keep the first block and the final 15% "
                     "of blocks BF16, the recipe their evidence measures (docs/results.md; "
                     "ds_configs/nvfp4_zero3.json).")
    plan = SchedulePlan.from_config(pc, ds)
    if plan.active:
        lines.append("  Schedule (precision.schedule, applied on optimizer-step boundaries): "
                     + "; ".join(plan.describe()) + ".")
    if base.frozen or base.checkpoint:
        lines.append("  Base (precision.base, docs/finetune.md): " + (
            "every converted weight frozen (requires_grad false); adapters (PEFT) and whatever else is trainable "
            "train" if base.frozen else "every weight trains") + (
            f"; read from the NVFP4 checkpoint {base.checkpoint}: " + (
                "each rank packs its own slice of the codes, which the forward multiplies as stored" if base.frozen
                else "the FP32 masters start at the dequantized codes (continued training)") if base.checkpoint
            else "") + ".")
    if pc.modules.fuse:
        lines.append(f"  Fused groups (one weight amax each, for inference engines): {pc.modules.fuse}")
    return lines


def _block_rules(pc: PrecisionConfig) -> str:
    m, parts = pc.modules, []
    if m.keep_first_blocks_bf16:
        parts.append(f"the first {m.keep_first_blocks_bf16}")
    if m.keep_last_blocks_bf16 or m.keep_last_fraction_bf16:
        frac = f"{m.keep_last_fraction_bf16:.0%} (rounded up)" if m.keep_last_fraction_bf16 else ""
        count = str(m.keep_last_blocks_bf16) if m.keep_last_blocks_bf16 else ""
        parts.append("the last " + (f"max({count}, {frac})" if frac and count else frac or count))
    return (", minus " + " and ".join(parts) + " transformer blocks") if parts else ""


def run(args: argparse.Namespace) -> int:
    try:
        ds, pc = load_config(args.file)
    except UnreadableConfig as exc:
        print(exc, file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    lines = describe(ds, pc)
    if args.model:
        from ._common import bad_input, conversion_lines, traffic_lines

        try:
            if pc.enabled:
                lines += conversion_lines(args.model, pc)
            lines += traffic_lines(args.model, ds, pc)
        except (ValueError, OSError) as exc:
            return bad_input("explain", exc)
    print("\n".join(lines))
    return 0
