"""What every subcommand does with bad input: one line on stderr naming the command, exit status 2."""

from __future__ import annotations

import argparse
import sys


def model_folder_parser(sub: argparse._SubParsersAction, name: str, help: str, inputs: list[tuple[str, str]],
                        formats: tuple[str, ...]) -> argparse.ArgumentParser:
    """A subcommand that writes one model folder (export, merge): its positional inputs, then OUT_DIR, ``--format``
    and ``--force``, with the exit statuses they share."""
    p = sub.add_parser(name, help=help, description="Exit 0: written; 2: bad input (nothing written).")
    for arg, text in inputs:
        p.add_argument(arg, help=text)
    p.add_argument("out_dir", help="new or empty folder (see --force)")
    p.add_argument("--format", required=True, choices=formats)
    p.add_argument("--force", action="store_true", help="replace an existing non-empty OUT_DIR whole")
    return p


def bad_input(command: str, exc: Exception) -> int:
    print(f"ds-nvfp4 {command}: {exc}", file=sys.stderr)
    return 2


def meta_model(model: str) -> tuple[object, str]:
    """``(module on the meta device, label)``: a reference GPT preset (``20m``, ``moe-5m``, ...) or a Hugging Face
    model directory / config.json (no weights are read or allocated). Raises ValueError naming the allowed values."""
    from pathlib import Path

    import torch

    from ..evaluation.gpt import GPT, MOE_PRESETS, PRESETS, model_spec

    path = Path(model)
    with torch.device("meta"):
        if model in PRESETS or model in MOE_PRESETS:
            net, label = GPT.from_spec(model_spec(model), 128), f"reference GPT {model}"
        elif path.exists():
            import transformers

            cfg = transformers.AutoConfig.from_pretrained(path.parent if path.is_file() else path)
            net, label = transformers.AutoModelForCausalLM.from_config(cfg), f"{cfg.model_type} from {path}"
        else:
            raise ValueError(f"--model {model!r}: not a reference preset ({', '.join([*PRESETS, *MOE_PRESETS])}) "
                             "and no such Hugging Face model directory or config.json")
    return net, label


def model_traffic(model: str, ds: dict, pc) -> tuple[object, str]:
    """``(StepTraffic, label)`` of ``model`` (:func:`meta_model`) trained with ds_config ``ds`` (precision
    ``pc``)."""
    from ..nn.convert import convert_model
    from ..zero.traffic import step_traffic

    net, label = meta_model(model)
    params = sum(p.numel() for p in {id(p): p for p in net.parameters()}.values())
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    packed = convert_model(net, pc).fp4_params if pc.enabled and pc.stored_packed(stage) else 0
    t = step_traffic(params, packed, all_gather=pc.communication.all_gather if pc.enabled else "bf16",
                     reduce_scatter=pc.communication.reduce_scatter if pc.enabled else "bf16",
                     block=pc.weights.block)
    return t, f"{label}, {params / 1e6:,.1f}M params"


def traffic_lines(model: str, ds: dict, pc) -> list[str]:
    """What one ZeRO-3 step moves per rank for ``model`` (see :func:`model_traffic`), as report lines."""
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage != 3:
        return [f"  Traffic: ZeRO stage {stage} all-reduces or reduce-scatters gradients only (no weight gathers)."]
    t, label = model_traffic(model, ds, pc)
    return [f"  ZeRO-3 traffic per optimizer step and rank ({label}): {t.describe()}.",
            "    (textbook ZeRO-3: gathered for the forward and again for the backward; ring collectives put "
            "(N-1)/N of it on each rank's link; docs/scaling.md)"]


def conversion_lines(model: str, pc) -> list[str]:
    """What ``convert_model`` makes of ``model`` (:func:`meta_model`) under ``pc``: the GEMM weights by kind and
    precision, each MoE experts module found (how it runs, its router), and every weight of unknown role."""
    from ..nn.convert import convert_model

    net, label = meta_model(model)
    report = convert_model(net, pc)
    gemm = [d for d in report.layers if d.kind in ("Linear", "Conv1D", "experts", "router")]
    lines = [f"  Conversion of {label}: {len(report.converted)} of {len(gemm)} GEMM weights NVFP4 "
             f"({report.fp4_by_kind()}); {report.fp4_params / max(1, report.fp4_params + report.bf16_params):.1%} "
             "of all parameters."]
    lines += [f"    MoE: {line}" for line in report.moe]
    experts_bf16 = [d for d in report.layers if d.kind == "experts" and not d.fp4]
    lines += [f"    experts kept BF16: {d.name}: {d.reason}" for d in experts_bf16[:6]]
    lines += [f"    {d.name}: {d.reason}" for d in report.unknown[:6]]
    if len(report.unknown) > 6:
        lines.append(f"    ... and {len(report.unknown) - 6} more weights of unknown role (kept BF16)")
    return lines
