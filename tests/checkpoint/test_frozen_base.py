"""``precision.base``: LoRA on a frozen NVFP4 base read from a published checkpoint (engine/base.py), each rank
packing its own slice of the checkpoint's codes (zero/packed.py ``pack_frozen``), multiplied as stored."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from ds_nvfp4.checkpoint.hf_nvfp4 import checkpoint_name, open_nvfp4_checkpoint
from ds_nvfp4.zero.partition import from_wire, partition_from_codes, partition_layout
from tests.checkpoint.tiny import (
    VOCAB,
    decompressed_llama,
    decompressed_moe,
    linears,
    llama_folder,
    moe_folder,
    tiny_llama,
    tiny_qwen3_moe,
)

PRESETS = Path(__file__).resolve().parents[2] / "ds_configs"
#: the tiny models the 2-rank scenarios build, by name (parameters cross processes as JSON)
BUILD = {"llama": lambda seed: tiny_llama(seed), "qwen3_moe": lambda seed: tiny_qwen3_moe(seed)}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = TARGETS[:4]


def ds_config(folder: str | None, **base) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "precision": {"enabled": True, "weights": {"block": "1x16"}, "communication": {"all_gather": "nvfp4"},
                          "base": {"frozen": True, "checkpoint": folder, **base}}}


def with_lora(model, targets: list[str] = TARGETS):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_each_ranks_slice_of_the_codes_gathers_to_the_checkpoint_weight(tmp_path: Path, fmt: str, world: int) -> None:
    """Every rank's ZeRO-3 element range read from the folder alone (rows it touches only), gathered as the NVFP4
    wire carries it, is the checkpoint's whole weight and its codes, bit for bit."""
    llama_folder(tmp_path / "ckpt", fmt)
    ckpt = open_nvfp4_checkpoint(tmp_path / "ckpt")
    checked = 0
    for module, w in ckpt.weights.items():
        numel = w.shape[0] * w.shape[1]
        part = -(-numel // world)
        layouts = [partition_layout(w.shape, part, world, "1x16", r) for r in range(world)]
        if not layouts[0].packable:
            continue
        wires = [partition_from_codes(ckpt.read_flat(module, r * part, (r + 1) * part), layouts[r]).wire()
                 for r in range(world)]
        weight, (data, scale, amax) = from_wire(torch.stack(wires), w.shape, "1x16", ckpt.amax(module))
        whole = ckpt.read(module)
        assert torch.equal(data, whole.data) and torch.equal(scale.view(torch.uint8), whole.scale.view(torch.uint8))
        assert torch.equal(weight, whole.dequantize(torch.float32)) and torch.equal(amax, whole.amax)
        checked += 1
    assert checked == 14


def test_peft_names_map_to_the_checkpoints() -> None:
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_adapters_stay_bf16_by_role_and_the_base_converts() -> None:
    from ds_nvfp4.nn import convert_model

    model = with_lora(tiny_llama(0))
    report = convert_model(model, ds_config(None)["precision"])
    rows = {d.name: d for d in report.layers}
    base = "base_model.model.model.layers.0.self_attn.q_proj"
    assert rows[f"{base}.base_layer"].fp4
    for ab in ("lora_A", "lora_B"):
        row = rows[f"{base}.{ab}.default"]
        assert not row.fp4 and row.reason.startswith(f"an adapter of {base}")


def train_steps(engine, rank: int, steps: int) -> list[float]:
    """``steps`` optimizer steps on one fixed batch per rank (adapters that learn lower its loss); the losses."""
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _frozen_entries(engine):
    return [e for e in engine.ds_nvfp4.store.frozen]


def scenario_lora_on_a_packed_checkpoint(rank: int, p: dict) -> dict:
    import deepspeed

    import ds_nvfp4
    from ds_nvfp4.nn.module import FP4Module

    build = BUILD[p.get("model", "llama")]
    build(0)  # transformers' lazy imports run torch._dynamo, which fails inside zero.Init's tensor patches
    cfg = ds_config(p["folder"])
    plain = {k: v for k, v in cfg.items() if k != "precision"}

    def engine_from_scratch(seed: int):
        with deepspeed.zero.Init(config_dict_or_path=plain):
            model = build(seed)
        model = with_lora(model, p.get("targets", TARGETS))
        engine, *_ = ds_nvfp4.initialize(model=model, config=copy.deepcopy(cfg),
                                         model_parameters=[q for q in model.parameters() if q.requires_grad])
        return engine

    engine = engine_from_scratch(5)
    store = engine.ds_nvfp4.store
    report = store.report()
    names = {id(q): n for n, q in engine.module.named_parameters()}
    trained = sorted(names[id(q)] for g in engine.optimizer.fp16_groups for q in g)
    fp32 = sum(t.numel() for t in engine.optimizer.fp32_partitioned_groups_flat)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.float()
    base_layers = [m for m in engine.module.modules() if isinstance(m, FP4Module)]
    quantizations = sum(c.quantizations for m in base_layers for _, _, c in m.fp4_weights())
    wires = {e.name: e.q.wire().clone() for e in _frozen_entries(engine)}

    engine.train()
    # one batch per rank, seen 6 times: adapters that learn lower its loss
    batches = [torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(100 + rank))] * 6
    losses = []
    for s, b in enumerate(batches):
        loss = engine(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if s == 2:
            engine.save_checkpoint(p["save"], tag="step3")
    frozen_unchanged = all(torch.equal(wires[e.name], e.q.wire()) for e in _frozen_entries(engine))

    resumed = engine_from_scratch(7)
    resumed.load_checkpoint(p["save"], tag="step3")
    resumed.train()
    again = []
    for b in batches[3:]:
        loss = resumed(input_ids=b, labels=b).loss
        resumed.backward(loss)
        resumed.step()
        again.append(float(loss))
    return {"report": report.to_dict(), "trained": trained, "fp32": fp32, "logits": logits.tolist(),
            "quantizations": quantizations, "losses": losses, "resumed": again, "frozen_unchanged": frozen_unchanged,
            "notes": engine.ds_nvfp4.conversion.notes}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_lora_on_a_packed_nvfp4_checkpoint_on_two_ranks(tmp_path: Path, fmt: str) -> None:
    """On 2 real ranks under zero.Init with PEFT LoRA: every base Linear's partition is packed from the checkpoint's
    own codes (0.5625 bytes per parameter, no FP32 master, only adapters in the optimizer), the first forward
    multiplies them as stored (no quantization; logits equal to a single-process model built from compressed-tensors'
    own decompressor, bit for bit), LoRA trains (loss falls, base bytes unchanged) and a resumed run continues with
    the same losses."""
    from tests.ranks import run_ranks

    llama_folder(tmp_path / "ckpt", fmt)
    tensors = llama_folder(tmp_path / "ct", "compressed-tensors")  # the same codes, for the reference's reader
    results = run_ranks(scenario_lora_on_a_packed_checkpoint, world_size=2, folder=str(tmp_path / "ckpt"),
                        save=str(tmp_path / "save"))
    base_numel = sum(tiny_llama(0).get_submodule(n).weight.numel() for n in linears(tiny_llama(0)))
    for r in results:
        rep = r["report"]
        # this rank's half: 4 bits + one E4M3 scale per 16 = 0.5625 bytes per parameter, and one FP32 amax per weight
        assert rep["frozen_params"] == 14 and rep["frozen_bytes"] == base_numel // 2 * 9 // 16 + 4 * 14, rep
        assert f"read as stored from {tmp_path / 'ckpt'} ({fmt})" in rep["frozen_source"]
        assert r["trained"] and all(".lora_" in n for n in r["trained"]), r["trained"]
        lora_numel = 2 * 8 * sum(64 + o for o in (64, 32, 32, 64, 128, 128)) + 2 * 8 * (128 + 64)
        assert r["fp32"] == lora_numel // 2  # the adapters' masters only, this rank's half
        assert r["quantizations"] == 0
        assert r["losses"][-1] < r["losses"][0] and r["frozen_unchanged"]
        assert r["resumed"] == r["losses"][3:]
    assert torch.equal(torch.tensor(results[0]["logits"]), reference_logits(tensors, tmp_path / "ckpt"))


def reference_logits(tensors: dict, folder: Path, lora: bool = True, ref=None,
                     targets: list[str] = TARGETS) -> torch.Tensor:
    """One process, no DeepSpeed: the model compressed-tensors' own decompressor gives (``ref``, default the tiny
    Llama from ``tensors``), converted with the same FP4 recipe and quantized with the checkpoint's global amaxes
    (experts: each expert's); float32 logits of the test's ids."""
    from ds_nvfp4.nn import convert_model

    ref = decompressed_llama(tensors) if ref is None else ref
    ref = with_lora(ref, targets) if lora else ref
    convert_model(ref, ds_config(None)["precision"])
    ckpt = open_nvfp4_checkpoint(folder)
    for name, m in ref.named_modules():
        for pname, _, codes in m.fp4_weights() if hasattr(m, "fp4_weights") else ():
            site = checkpoint_name(name)
            codes.agreed_amax = (ckpt.amax(site) if pname == "weight" else torch.stack(
                [ckpt.amax(f"{site}.{e}.{'down_proj' if pname == 'down_proj' else 'gate_proj'}")
                 for e in range(codes.experts)]))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return ref(input_ids=ids).logits.float()


def _adapter(folder: Path, seed: int = 4, model=None) -> None:
    """PEFT adapters of ``model`` (default: LoRA on the tiny Llama) with random (trained-looking) A and B, in PEFT's
    format."""
    model = with_lora(tiny_llama(0)) if model is None else model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(folder)


def _merge(tmp_path: Path, fmt: str, layers: int) -> Path:
    """``ds-nvfp4 merge tmp_path/ckpt tmp_path/adapter tmp_path/merged --format fmt``, which must say it merged
    ``layers`` LoRA-adapted layers; the output folder."""
    import subprocess
    import sys

    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, "-m", "ds_nvfp4", "merge", str(tmp_path / "ckpt"), str(tmp_path / "adapter"),
                        str(out), "--format", fmt], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"merged {layers} LoRA-adapted layers" in r.stdout, r.stderr[-2000:]
    return out


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4-compressed-tensors", "nvfp4-modelopt"])
def test_merge_writes_the_base_plus_the_adapters(tmp_path: Path, fmt: str) -> None:
    """``ds-nvfp4 merge``: every merged weight is the checkpoint's dequantized weight + scaling * B @ A (FP32, then
    BF16 or quantized again with one global scale per fused group); the folder loads in transformers (BF16) or
    validates as NVFP4 with the base's BF16 modules kept."""

    from safetensors.torch import load_file

    from ds_nvfp4 import quantize

    llama_folder(tmp_path / "ckpt")
    _adapter(tmp_path / "adapter")
    out = _merge(tmp_path, fmt, layers=14)
    ckpt = open_nvfp4_checkpoint(tmp_path / "ckpt")
    lora = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    expected = {}
    for module in ckpt.weights:
        key = f"base_model.model.{module}"
        a, b = lora[f"{key}.lora_A.weight"], lora[f"{key}.lora_B.weight"]
        expected[module] = ckpt.read(module).dequantize(torch.float32) + 2.0 * (b @ a)  # lora_alpha / r = 2
    if fmt == "bf16":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out)
        for module, want in expected.items():
            assert torch.equal(model.get_submodule(module).weight, want.to(torch.bfloat16)), module
        return
    merged = open_nvfp4_checkpoint(out)
    assert set(merged.weights) == set(expected) and merged.ignore == ["lm_head"]
    for module, want in expected.items():
        got = merged.read(module)
        ref = quantize(want, block="1x16", amax=merged.amax(module))
        assert torch.equal(got.data, ref.data) and torch.equal(got.dequantize(), ref.dequantize()), module


def test_merge_refuses_a_folder_that_is_not_an_adapter(tmp_path: Path) -> None:
    from ds_nvfp4.export.merge import merge
    from ds_nvfp4.export.writer import ExportError

    llama_folder(tmp_path / "ckpt")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ExportError, match=r"no adapter_config\.json: not a PEFT adapter folder"):
        merge(tmp_path / "ckpt", tmp_path / "nothing", tmp_path / "out", "bf16")
    assert not (tmp_path / "out").exists()


def scenario_lora_on_a_frozen_bf16_base(rank: int, p: dict) -> dict:
    import deepspeed

    import ds_nvfp4
    from ds_nvfp4 import quantize

    tiny_llama(0)  # transformers' lazy imports first (see above)
    cfg = json.loads((PRESETS / "nvfp4_zero3.json").read_text())  # the shipped preset: 16x16 tiles, BF16 gathers
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    cfg["precision"]["base"] = {"frozen": True}
    cfg["precision"]["modules"] = {"keep_first_blocks_bf16": 0, "keep_last_blocks_bf16": 0}  # 2 blocks only
    plain = {k: v for k, v in cfg.items() if k != "precision"}
    with deepspeed.zero.Init(config_dict_or_path=plain):
        model = tiny_llama(5)
    model = with_lora(model)
    layer = model.get_submodule("base_model.model.model.layers.1.mlp.down_proj.base_layer")
    with deepspeed.zero.GatheredParameters([layer.weight]):
        before = layer.weight.detach().clone()
    engine, *_ = ds_nvfp4.initialize(model=model, config=cfg,
                                     model_parameters=[q for q in model.parameters() if q.requires_grad])
    report = engine.ds_nvfp4.store.report()
    with deepspeed.zero.GatheredParameters([layer.weight]):
        stored = layer.weight.detach().clone()
    want = quantize(before.float(), block="16x16").dequantize(torch.bfloat16)
    wires = {e.name: e.q.wire().clone() for e in engine.ds_nvfp4.store.frozen}
    losses = train_steps(engine, rank, 4)
    return {"report": report.to_dict(), "stored_is_quantized_once": bool(torch.equal(stored, want)),
            "losses": losses, "frozen_unchanged": all(torch.equal(wires[e.name], e.q.wire())
                                                      for e in engine.ds_nvfp4.store.frozen)}


@pytest.mark.slow
def test_a_frozen_base_without_a_checkpoint_is_packed_once_from_its_bf16_partitions(tmp_path: Path) -> None:
    """``base.frozen`` alone, with the shipped preset (16x16 tiles, BF16 gathers): the frozen weights are quantized
    once with the amax agreed across ranks (the gathered weight is the whole BF16 weight's quantization), never
    again while the adapters train."""
    from tests.ranks import run_ranks

    for r in run_ranks(scenario_lora_on_a_frozen_bf16_base, world_size=2):
        assert r["report"]["frozen_params"] == 14 and "quantized once" in r["report"]["frozen_source"], r
        assert r["stored_is_quantized_once"] and r["frozen_unchanged"]
        assert r["losses"][-1] < r["losses"][0], r["losses"]


def continued_engine(build, folder: str):
    """A model ``build(seed)`` made under zero.Init, then ``ds_nvfp4.initialize`` with ``base.checkpoint`` (not
    frozen): continued training from the folder; returns the engine and the opened checkpoint."""
    import deepspeed

    import ds_nvfp4

    build(0)  # transformers' lazy imports outside zero.Init
    cfg = ds_config(folder, frozen=False)
    with deepspeed.zero.Init(config_dict_or_path={k: v for k, v in cfg.items() if k != "precision"}):
        model = build(5)
    engine, *_ = ds_nvfp4.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine, open_nvfp4_checkpoint(folder)


def scenario_continued_training_from_a_checkpoint(rank: int, p: dict) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    engine, ckpt = continued_engine(tiny_llama, p["folder"])
    masters = {}
    for name, q in engine.module.named_parameters():
        module = name.removesuffix(".weight")
        if module in ckpt.weights:
            got, want = safe_get_full_fp32_param(q), ckpt.read(module).dequantize(torch.float32)
            masters[name] = bool(torch.equal(got, want)) or f"max diff {float((got - want).abs().max())}"
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.float()
    return {"masters": masters, "logits": logits.tolist(), "trained": sum(len(g) for g in engine.optimizer.fp16_groups)}


@pytest.mark.slow
def test_continued_training_masters_start_at_the_checkpoint_and_step_0_multiplies_its_codes(tmp_path: Path) -> None:
    """``base.checkpoint`` without ``frozen``: every weight trains, its FP32 master is the dequantized checkpoint
    weight, and (1x16 blocks, NVFP4 gathers) the first forward's logits equal the reference's bit for bit."""
    from tests.ranks import run_ranks

    tensors = llama_folder(tmp_path / "ckpt")
    results = run_ranks(scenario_continued_training_from_a_checkpoint, world_size=2, folder=str(tmp_path / "ckpt"))
    for r in results:
        assert len(r["masters"]) == 14 and all(v is True for v in r["masters"].values()), r["masters"]
        assert r["trained"] == len(list(tiny_llama(0).parameters()))
    assert torch.equal(torch.tensor(results[0]["logits"]), reference_logits(tensors, tmp_path / "ckpt", lora=False))


def test_continued_training_loads_per_expert_tensors_into_transformers_fused_experts(tmp_path: Path) -> None:
    """A MoE checkpoint with per-expert names (experts.{e}.gate_proj / up_proj / down_proj) loads into Qwen3-MoE's
    fused ``[E, 2I, H]`` / ``[E, H, I]`` parameters: each expert's rows are its dequantized codes (in BF16, what
    compressed-tensors' own decompressor returns)."""
    from ds_nvfp4.config import PrecisionConfig
    from ds_nvfp4.engine.base import open_base, prepare_base
    from ds_nvfp4.nn import convert_model

    expect = moe_folder(tmp_path / "ckpt", tiny_qwen3_moe(0), bf16_experts_layer=1)
    pc = PrecisionConfig.model_validate({"enabled": True, "weights": {"block": "1x16"},
                                         "base": {"checkpoint": str(tmp_path / "ckpt")}})
    model = tiny_qwen3_moe(1)
    plan = open_base(model, pc)
    report = convert_model(model, pc, bf16_reasons=plan.bf16_reasons)
    prepare_base(model, plan, pc, report)
    rows = {d.name: d for d in report.layers}
    assert rows["model.layers.0.mlp.experts.gate_up_proj"].fp4
    assert not rows["model.layers.1.mlp.experts.gate_up_proj"].fp4
    assert "the checkpoint stores its experts BF16" in rows["model.layers.1.mlp.experts.gate_up_proj"].reason
    assert sorted(plan.experts) == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                    for p in ("down_proj", "gate_up_proj")]
    assert plan.load.unused == [], plan.load.unused  # every per-expert tensor went into a fused parameter
    for i in range(2):
        site = f"model.layers.{i}.mlp.experts"
        for e in range(4):
            gate_up = model.get_parameter(f"{site}.gate_up_proj")[e].to(torch.bfloat16)
            assert torch.equal(gate_up, torch.cat([expect[f"{site}.{e}.gate_proj"], expect[f"{site}.{e}.up_proj"]]))
            down = model.get_parameter(f"{site}.down_proj")[e].to(torch.bfloat16)
            assert torch.equal(down, expect[f"{site}.{e}.down_proj"])


def frozen_moe_decisions(folder: Path, bf16_experts_layer: int | None = None):
    """The opened checkpoint and the experts rows of a tiny Qwen3-MoE converted for a frozen base from ``folder``."""
    from ds_nvfp4.config import PrecisionConfig
    from ds_nvfp4.engine.base import open_base
    from ds_nvfp4.nn import convert_model

    moe_folder(folder, tiny_qwen3_moe(0), bf16_experts_layer=bf16_experts_layer)
    pc = PrecisionConfig.model_validate(ds_config(str(folder))["precision"])
    model = tiny_qwen3_moe(1)
    plan = open_base(model, pc)
    report = convert_model(model, pc, bf16_reasons=plan.bf16_reasons)
    return plan.checkpoint, [d for d in report.layers if d.kind == "experts"]


@pytest.mark.parametrize("world", [2, 8, 512])
def test_each_ranks_slice_of_the_per_expert_codes_gathers_to_the_fused_experts(tmp_path: Path, world: int) -> None:
    """A frozen MoE base: every rank's ZeRO-3 range of Qwen3-MoE's fused ``[E, 2I, H]`` / ``[E, H, I]`` experts is
    read from the checkpoint's per-expert tensors (gate's rows then up's), one segment per expert it touches with
    that expert's global scale; gathered as the NVFP4 wire carries it, it is every expert's stored codes and
    dequantized weight, bit for bit. 512 ranks cut rows in half (down_proj: 16 of 32 columns per rank)."""
    from ds_nvfp4.engine.base import _expert_source

    ckpt, rows = frozen_moe_decisions(tmp_path / "ckpt")
    for d in rows:
        assert d.fp4, d
        site, _, pname = d.name.rpartition(".")
        projections = ["gate_proj", "up_proj"] if pname == "gate_up_proj" else ["down_proj"]
        shape = (d.experts, d.out_features, d.in_features)
        part = d.experts * d.out_features * d.in_features // world
        layouts = [partition_layout(shape, part, world, "1x16", r) for r in range(world)]
        assert all(lay.packable for lay in layouts)
        codes = [_expert_source(ckpt, d)(r * part, (r + 1) * part) for r in range(world)]
        parts = [partition_from_codes(c, lay) for c, lay in zip(codes, layouts)]
        weight, (data, scale, amax) = from_wire(torch.stack([q.wire() for q in parts]), shape, "1x16", codes[0][2])
        # each rank's own dequantization (its segments' amaxes) is its range of the weight
        flat = weight.reshape(-1)
        assert all(torch.equal(q.dequantize(torch.float32), flat[r * part: (r + 1) * part])
                   for r, q in enumerate(parts))
        stored = [[ckpt.read(f"{site}.{e}.{proj}") for proj in projections] for e in range(d.experts)]
        assert torch.equal(data, torch.stack([torch.cat([q.data for q in qs]) for qs in stored]))
        assert torch.equal(scale.view(torch.uint8),
                           torch.stack([torch.cat([q.scale.view(torch.uint8) for q in qs]) for qs in stored]))
        assert torch.equal(amax, torch.stack([qs[0].amax for qs in stored]))
        assert torch.equal(weight, torch.stack([torch.cat([q.dequantize(torch.float32) for q in qs])
                                                for qs in stored]))


def test_a_frozen_experts_weight_that_cannot_take_the_stored_codes_is_refused_by_name(tmp_path: Path) -> None:
    """Experts stored ``[E, K, N]`` (GPT-OSS, Llama 4) would block along N, the checkpoint along K; experts the
    checkpoint keeps BF16 have no codes: each refusal names the parameter and says what to do."""
    import dataclasses

    from ds_nvfp4.checkpoint.metadata import CheckpointError
    from ds_nvfp4.config import ConfigError
    from ds_nvfp4.engine.base import _expert_source

    ckpt, rows = frozen_moe_decisions(tmp_path / "ckpt", bf16_experts_layer=1)
    d = next(d for d in rows if d.name == "model.layers.0.mlp.experts.gate_up_proj")
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj stores its experts "
                                          r"transposed .* set precision\.base\.frozen false"):
        _expert_source(ckpt, dataclasses.replace(d, transposed=True))
    bf16 = next(d for d in rows if d.name == "model.layers.1.mlp.experts.gate_up_proj")
    assert not bf16.fp4 and "the checkpoint stores its experts BF16" in bf16.reason
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.0\.gate_proj is not NVFP4"):
        _expert_source(ckpt, bf16)


def scenario_continued_moe_training(rank: int, p: dict) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    engine, ckpt = continued_engine(tiny_qwen3_moe, p["folder"])
    equal = {}
    for name, q in engine.module.named_parameters():
        site, _, pname = name.rpartition(".")
        if pname == "gate_up_proj":
            want = torch.stack([torch.cat([ckpt.read(f"{site}.{e}.gate_proj").dequantize(torch.float32),
                                           ckpt.read(f"{site}.{e}.up_proj").dequantize(torch.float32)])
                                for e in range(4)])
        elif pname == "down_proj" and site.endswith("experts"):
            want = torch.stack([ckpt.read(f"{site}.{e}.down_proj").dequantize(torch.float32) for e in range(4)])
        else:
            continue
        equal[name] = bool(torch.equal(safe_get_full_fp32_param(q), want))
    losses = train_steps(engine, rank, 3)
    return {"equal": equal, "losses": losses}


@pytest.mark.slow
def test_continued_moe_training_on_two_ranks_starts_at_the_checkpoints_experts(tmp_path: Path) -> None:
    """ZeRO-3 on 2 ranks: the FP32 masters of Qwen3-MoE's fused experts are the checkpoint's per-expert codes
    dequantized (each rank its own range), and training runs from there."""
    from tests.ranks import run_ranks

    moe_folder(tmp_path / "ckpt", tiny_qwen3_moe(0))
    for r in run_ranks(scenario_continued_moe_training, world_size=2, folder=str(tmp_path / "ckpt")):
        assert len(r["equal"]) == 4 and all(r["equal"].values()), r["equal"]
        assert r["losses"][-1] < r["losses"][0], r["losses"]


@pytest.mark.slow
def test_lora_on_a_frozen_moe_checkpoint_packs_the_per_expert_codes_on_two_ranks(tmp_path: Path) -> None:
    """A frozen Qwen3-MoE base from a checkpoint with per-expert names, 2 real ranks under zero.Init with PEFT LoRA:
    the fused experts' partitions are packed from the per-expert codes as stored (0.5625 bytes per parameter, one
    amax per expert segment), no FP32 master outside the adapters, the first forward multiplies the codes as stored
    (logits equal to compressed-tensors' decompressed model's, bit for bit), LoRA trains with the base unchanged and
    a resumed run continues with the same losses."""
    from tests.ranks import run_ranks

    expect = moe_folder(tmp_path / "ckpt", tiny_qwen3_moe(0))
    results = run_ranks(scenario_lora_on_a_packed_checkpoint, world_size=2, folder=str(tmp_path / "ckpt"),
                        save=str(tmp_path / "save"), model="qwen3_moe", targets=ATTENTION)
    attention = 2 * (64 * 64 * 2 + 32 * 64 * 2)
    experts = 2 * (4 * 64 * 64 + 4 * 64 * 32)
    for r in results:
        rep = r["report"]
        # this rank's half at 0.5625 bytes per parameter, an amax per attention weight and per expert segment (each
        # rank holds 2 of the 4 experts of each fused weight)
        assert rep["frozen_params"] == 12, rep
        assert rep["frozen_bytes"] == (attention + experts) // 2 * 9 // 16 + 4 * 8 + 4 * 2 * 4, rep
        assert r["trained"] and all(".lora_" in n for n in r["trained"]), r["trained"]
        assert r["fp32"] == 2 * 8 * sum(64 + o for o in (64, 32, 32, 64)) // 2  # q/k/v/o adapters of 2 layers
        assert r["quantizations"] == 0
        assert r["losses"][-1] < r["losses"][0] and r["frozen_unchanged"], r["losses"]
        assert r["resumed"] == r["losses"][3:]
        # the 4 fused experts weights too: packed from the per-expert codes, not set from dequantized values
        assert any("12 weights to be packed from their stored codes" in n for n in r["notes"]), r["notes"]
    assert torch.equal(torch.tensor(results[0]["logits"]),
                       reference_logits({}, tmp_path / "ckpt", ref=decompressed_moe(expect), targets=ATTENTION))


def test_peft_lora_on_the_fused_experts_of_a_frozen_checkpoint_base_is_refused_with_what_to_target(
        tmp_path: Path) -> None:
    """PEFT's ParamWrapper (target_modules gate_proj / up_proj / down_proj on transformers' fused experts) adds the
    adapter's delta to the weight before each GEMM: the stored codes cannot be multiplied as stored. One error names
    the parameter and the targets that work, before any parameter changes."""
    from ds_nvfp4.config import ConfigError, PrecisionConfig
    from ds_nvfp4.engine.base import open_base, prepare_base
    from ds_nvfp4.nn import convert_model

    moe_folder(tmp_path / "ckpt", tiny_qwen3_moe(0))
    pc = PrecisionConfig.model_validate(ds_config(str(tmp_path / "ckpt"))["precision"])
    model = with_lora(tiny_qwen3_moe(1))
    plan = open_base(model, pc)
    report = convert_model(model, pc, bf16_reasons=plan.bf16_reasons)
    trainable = [n for n, q in model.named_parameters() if q.requires_grad]
    with pytest.raises(ConfigError, match=r"stores model\.layers\.0\.mlp\.experts\.gate_up_proj per expert, but "
                                          r".*experts\.base_layer\.base_layer\.gate_up_proj cannot take it: PEFT "
                                          r"wraps it .* target_modules=\['q_proj', 'k_proj', 'v_proj', 'o_proj'\]"):
        prepare_base(model, plan, pc, report)
    assert [n for n, q in model.named_parameters() if q.requires_grad] == trainable


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4-compressed-tensors"])
def test_merge_of_a_moe_base_writes_the_experts_under_the_bases_per_expert_names(tmp_path: Path, fmt: str) -> None:
    """``ds-nvfp4 merge`` of attention adapters into a MoE base with per-expert names: the experts come from the
    per-expert codes into transformers' fused parameters (BF16: the folder loads in transformers with each
    expert's rows dequantized), or go back under the base's per-expert names re-quantized once per expert matrix
    (gate and up share its global scale, as the base's did); the attention weights are base + scaling * B @ A."""

    from safetensors.torch import load_file

    from ds_nvfp4 import quantize

    moe_folder(tmp_path / "ckpt", tiny_qwen3_moe(0))
    _adapter(tmp_path / "adapter", model=with_lora(tiny_qwen3_moe(0), ATTENTION))
    out = _merge(tmp_path, fmt, layers=8)
    ckpt = open_nvfp4_checkpoint(tmp_path / "ckpt")
    lora = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    attention = {m: ckpt.read(m).dequantize(torch.float32) + 2.0 * (lora[f"base_model.model.{m}.lora_B.weight"]
                                                                    @ lora[f"base_model.model.{m}.lora_A.weight"])
                 for m in ckpt.weights if ".self_attn." in m}
    experts = {f"model.layers.{i}.mlp.experts.{e}": torch.cat([ckpt.read(f"model.layers.{i}.mlp.experts.{e}.{p}")
                                                               .dequantize(torch.float32)
                                                               for p in ("gate_proj", "up_proj")])
               for i in range(2) for e in range(4)}
    if fmt == "bf16":
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(out)
        for m, want in attention.items():
            assert torch.equal(merged.get_submodule(m).weight, want.to(torch.bfloat16)), m
        for site, want in experts.items():
            fused, _, e = site.rpartition(".")
            assert torch.equal(merged.get_parameter(f"{fused}.gate_up_proj")[int(e)], want.to(torch.bfloat16)), site
        return
    merged = open_nvfp4_checkpoint(out)  # validates: each expert's gate and up share one global scale
    assert set(merged.weights) == set(ckpt.weights)
    for site, want in experts.items():
        q = quantize(want, block="1x16", amax=merged.amax(f"{site}.gate_proj"))  # the amax as the file holds it
        got = torch.cat([merged.read(f"{site}.{p}").dequantize(torch.float32) for p in ("gate_proj", "up_proj")])
        assert torch.equal(got, q.dequantize(torch.float32)), site
    for m, want in attention.items():
        assert torch.equal(merged.read(m).dequantize(), quantize(want, block="1x16",
                                                                 amax=merged.amax(m)).dequantize()), m
