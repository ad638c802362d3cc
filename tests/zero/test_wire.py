"""The gather wire formats (zero/wire.py) on their own: what a partition sends and how the gathered bytes become the
weight, checked against quantizing the whole weight; the registry agrees with the schema. The formats on real
DeepSpeed ranks are checked by tests/zero/test_zero3.py (``all_gather`` bf16 and nvfp4 give the same bits)."""

from __future__ import annotations

import typing
from types import SimpleNamespace

import pytest
import torch

from ds_nvfp4.config.schema import CommunicationConfig
from ds_nvfp4.format import quantize
from ds_nvfp4.nn.weights import WeightCodes
from ds_nvfp4.zero import wire
from ds_nvfp4.zero.packed import Entry
from ds_nvfp4.zero.partition import local_amax, pack_partition, partition_layout


def test_the_schema_accepts_exactly_the_registered_formats() -> None:
    literal = typing.get_args(CommunicationConfig.model_fields["all_gather"].annotation)
    assert set(literal) == set(wire.names()) == {"bf16", "nvfp4"}


def _ranks(weight: torch.Tensor, world: int, block: str) -> list[Entry]:
    """Every rank's :class:`Entry` of ``weight`` as the packed storage holds it: a packed partition, and the
    parameter DeepSpeed gives ZeRO-3 attributes to (``ds_tensor``, ``ds_shape``)."""
    flat = weight.reshape(-1)
    per = flat.numel() // world
    amax = flat.abs().amax().float()
    out = []
    for r in range(world):
        layout = partition_layout(tuple(weight.shape), per, world, block, r)
        assert layout.packable
        part = flat.narrow(0, r * per, per)
        assert float(local_amax(part, layout)) <= float(amax)
        p = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
        p.ds_tensor, p.ds_shape = torch.empty(0, dtype=torch.bfloat16), weight.shape
        codes = WeightCodes()
        codes.agreed_amax = amax
        out.append(Entry(p, "w", 0, 0, per, layout, pack_partition(part, layout, block, amax), codes))
    return out


def _store(block: str) -> SimpleNamespace:
    from ds_nvfp4.format.constants import E4M3_MAX

    return SimpleNamespace(block=block, e4m3_bound=E4M3_MAX, gathered_bytes=0, world_size=lambda e: 2,
                           seconds={"dequantize_for_gather": 0.0})


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_nvfp4_wire_gives_the_whole_weights_dequantization_and_codes(block: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 48) * 0.1
    entries = _ranks(weight, 2, block)
    fmt = wire.wire_format("nvfp4")
    sent = [fmt.pre_all_gather(_store(block), e) for e in entries]
    assert sent[0].dtype == torch.uint8 and sent[0].numel() == sent[1].numel() == 64 * 48 // 2 // 2 + (
        64 * 48 // 16 // 2 if block == "1x16" else 64 * 48 // 256 // 2)
    gathered = torch.stack(sent)  # [world, bytes] in rank order, as all_gather_into_tensor lays it out
    e = entries[0]
    fmt.post_all_gather(_store(block), e, gathered)
    whole = quantize(weight, block=block, amax=weight.abs().amax().float())
    assert torch.equal(e.param.data.float(), whole.dequantize(torch.float32).to(torch.bfloat16).float())
    data, scale, _ = e.codes.reuse(e.param)  # what the layer multiplies instead of quantizing again
    assert torch.equal(data, whole.data) and torch.equal(scale.view(torch.uint8), whole.scale.view(torch.uint8))


def test_bf16_wire_puts_a_transient_partition_where_deepspeed_gathers_and_drops_it() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 32)
    entries = _ranks(weight, 2, "1x16")
    fmt, store = wire.wire_format("bf16"), _store("1x16")
    assert fmt.deepspeed_collective
    sent = [fmt.pre_all_gather(store, e) for e in entries]
    both = torch.cat([s.float() for s in sent])
    whole = quantize(weight, block="1x16", amax=weight.abs().amax().float())
    assert torch.equal(both, whole.dequantize(torch.bfloat16).reshape(-1).float())
    assert entries[0].param.ds_tensor.numel() == 32 * 32 // 2 and store.gathered_bytes == 2 * (32 * 32 // 2) * 2 * 2
    for e in entries:
        fmt.post_all_gather(store, e, None)
        assert e.param.ds_tensor.numel() == 0


def test_a_new_format_is_one_registered_class_and_a_name_clash_is_refused() -> None:
    class Rowwise(wire.NVFP4Wire):
        name = "test_rowwise"

    try:
        wire.register(Rowwise)
        assert isinstance(wire.wire_format("test_rowwise"), Rowwise)

        class Clash(wire.NVFP4Wire):
            name = "test_rowwise"

        with pytest.raises(ValueError, match="registered twice"):
            wire.register(Clash)
    finally:
        wire._FORMATS.pop("test_rowwise", None)
    with pytest.raises(ValueError, match="'bf16', 'nvfp4'"):
        wire.wire_format("fp8")
