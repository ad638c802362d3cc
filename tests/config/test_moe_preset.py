"""The shipped MoE preset is the recipe its evidence measured (docs/moe.md, "MoE quality")."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _precision(path: Path) -> dict:
    return json.loads(path.read_text())["precision"]


def _converted(spec: dict, precision: dict) -> set[str]:
    from ds_nvfp4.evaluation.gpt import GPT
    from ds_nvfp4.nn.convert import convert_model

    return set(convert_model(GPT.from_spec(spec, 16), precision).converted)  # names only: no seed matters


def test_the_moe_preset_converts_what_the_moe_evidence_converted_and_the_default_blocks_from_7_on() -> None:
    """On the moe-5m reference model (6 blocks) the preset makes FP4 exactly the weights of the evidence runs'
    configuration (bench/configs/nvfp4_zero3_moe_last2.json: blocks 1-3), one block fewer than the default; from 7
    blocks on its fraction rule keeps at least 2 trailing blocks anyway, so there it converts what the default does."""
    from ds_nvfp4.evaluation.gpt import model_spec

    preset = _precision(ROOT / "ds_configs" / "nvfp4_zero3_moe.json")
    measured = _precision(ROOT / "bench" / "configs" / "nvfp4_zero3_moe_last2.json")
    default = _precision(ROOT / "ds_configs" / "nvfp4_zero3.json")
    assert {k: v for k, v in preset.items() if k != "modules"} == {k: v for k, v in default.items() if k != "modules"}

    def blocks(names: set[str]) -> set[int]:
        return {int(n.split(".")[1]) for n in names if n.startswith("blocks.")}

    spec = model_spec("moe-5m")
    got = _converted(spec, preset)
    assert got == _converted(spec, measured)
    assert blocks(got) == {1, 2, 3} and any(".experts." in n for n in got)
    assert blocks(_converted(spec, default)) == {1, 2, 3, 4}

    for layers, fp4 in ((7, range(1, 5)), (20, range(1, 17))):  # ceil(0.15 * 7) = 2, ceil(0.15 * 20) = 3
        deep = dict(spec, layers=layers)
        assert blocks(_converted(deep, preset)) == blocks(_converted(deep, default)) == set(fp4)
