"""What transformers' ``from_pretrained`` does with an NVFP4 (compressed-tensors) export of an MoE model, per family.

Usage: python bench/moe_loaders.py [--families qwen3_moe deepseek_v3 ...] [--json docs/evidence/moe_loaders.json]
For each family a tiny model (tests/integrations/moe_families.py) is written as ``ds-nvfp4 export --format
nvfp4-compressed-tensors`` writes an MoE model: every Linear and router BF16 and listed in ``ignore``, every expert
matrix NVFP4 under the per-expert names (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, biases with them;
ds_nvfp4/export/units.py), then loaded with ``AutoModelForCausalLM.from_pretrained``. Records per family: raised
(with the error), or loaded, and then whether the loaded experts equal the dequantized codes ("exact"), differ
("garbage": the NVFP4 bytes were not decompressed into them) or were left at initialisation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_nvfp4.export.formats import compressed_tensors_config, nvfp4_tensors
from ds_nvfp4.format import quantize
from ds_nvfp4.nn import convert_model
from tests.integrations.moe_families import build

_ROWS = {"all": lambda n: slice(0, n), "first_half": lambda n: slice(0, n // 2),
         "second_half": lambda n: slice(n // 2, n), "even": lambda n: slice(0, n, 2), "odd": lambda n: slice(1, n, 2)}


#: the precision sections tried: every block FP4, and the shipped default preset's (first and last blocks BF16: an
#: export then mixes BF16 per-expert weights and NVFP4 ones)
CASES = {"all blocks": {"enabled": True},
         "default preset": {"enabled": True, "modules": {"keep_first_blocks_bf16": 1, "keep_last_fraction_bf16": 0.15}}}


def one(family: str, tmp: Path, precision: dict) -> dict:
    import copy

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = build(family).to(torch.bfloat16)
    report = convert_model(copy.deepcopy(model), precision)
    experts = {d.name: d for d in report.layers if d.kind == "experts" and d.projections}
    if not experts:
        return {"result": "no declared per-expert layout (export refuses NVFP4)"}
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tensors, want = {}, {}
    for name, d in experts.items():
        module, value = name.rsplit(".", 1)[0], sd.pop(name)
        bias = sd.pop(f"{module}.{d.bias}", None) if d.bias else None
        for e in range(value.shape[0]):
            mat = (value[e].t() if d.transposed else value[e]).float()
            q = quantize(mat, block="16x16")
            want[f"{name}.{e}"] = q.dequantize(torch.bfloat16) if d.fp4 else mat.to(torch.bfloat16)
            for proj, sel in d.projections:
                rows = _ROWS[sel](mat.shape[0])
                if d.fp4:
                    tensors.update(nvfp4_tensors("nvfp4-compressed-tensors", f"{module}.{e}.{proj}", q, rows, None))
                else:  # a BF16 expert (edge blocks): per-expert BF16 weights, as the export writes them
                    tensors[f"{module}.{e}.{proj}.weight"] = mat[rows].to(torch.bfloat16).contiguous()
                if bias is not None:
                    tensors[f"{module}.{e}.{proj}.bias"] = bias[e][rows].contiguous()
    tensors.update({k: v.contiguous() for k, v in sd.items()})
    ignore = [d.name for d in report.layers if d.kind in ("Linear", "router")]
    out = tmp / f"{family}-{len(str(precision))}"
    model.config.quantization_config = compressed_tensors_config(ignore, "W4A16")
    model.config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    try:
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    except Exception as exc:
        return {"result": "raises", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    got = dict(loaded.named_parameters())
    exact = []
    for name, d in experts.items():
        param = got.get(name)
        if param is None:
            return {"result": "loads, experts parameter missing", "parameter": name}
        if d.fp4:
            for e in range(param.shape[0]):
                mat = param[e].t() if d.transposed else param[e]
                exact.append(bool(torch.equal(mat.to(torch.bfloat16), want[f"{name}.{e}"])))
    return {"result": "loads, NVFP4 experts exact" if all(exact) else
            ("loads, NVFP4 experts garbage (not the dequantized codes)" if not any(exact) else
             "loads, NVFP4 experts partly exact")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3",
                                                       "granitemoe", "gpt_oss"])
    ap.add_argument("--json")
    args = ap.parse_args()
    import compressed_tensors
    import transformers

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            for case, precision in CASES.items():
                results.setdefault(family, {})[case] = one(family, Path(tmp), precision)
                print(f"{family} ({case}): {results[family][case]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"transformers": transformers.__version__,
                                               "compressed_tensors": compressed_tensors.__version__,
                                               "families": results}, indent=2))


if __name__ == "__main__":
    main()
