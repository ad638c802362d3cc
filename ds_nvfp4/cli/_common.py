"""What every subcommand does with bad input: one line on stderr naming the command, exit status 2."""

from __future__ import annotations

import sys


def bad_input(command: str, exc: Exception) -> int:
    print(f"ds-nvfp4 {command}: {exc}", file=sys.stderr)
    return 2


def model_traffic(model: str, ds: dict, pc) -> tuple[object, str]:
    """``(StepTraffic, label)`` of ``model`` trained with ds_config ``ds`` (precision ``pc``).

    ``model``: a reference GPT preset (``20m``, ``moe-5m``, ...) or a Hugging Face model directory / config.json
    (built on the meta device: no weights are read or allocated). Raises ValueError naming the allowed values.
    """
    from pathlib import Path

    import torch

    from ..evaluation.gpt import GPT, MOE_PRESETS, PRESETS, model_spec
    from ..nn.convert import convert_model
    from ..zero.traffic import step_traffic

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
