"""GEMM backends: the emulation against the reference, the native paths' arguments, dispatch decisions."""

from __future__ import annotations

import pytest
import torch

import ds_nvfp4
from ds_nvfp4.kernels import BackendUnavailable, DeviceInfo, decide, get_backend, select
from ds_nvfp4.kernels.emulated import reference
from ds_nvfp4.kernels.swizzle import swizzle_128x4, swizzle_offset
from ds_nvfp4.kernels.torch_native import build_scaled_mm_args
from tests.reference import ref_fp4_gemm


@pytest.mark.parametrize("m, n, k", [(64, 32, 128), (37, 48, 64), (1, 16, 16)])
def test_emulated_gemm_is_bit_exact(m: int, n: int, k: int) -> None:
    a = torch.randn(m, k)
    b = torch.empty(n, k).cauchy_()
    got = reference.mm(ds_nvfp4.quantize(a), ds_nvfp4.quantize(b, block="16x16"), torch.float32)
    assert torch.equal(got, ref_fp4_gemm(a, b))  # the FP32-operand mode; BF16 operands: tests/kernels/test_operand.py


@pytest.mark.parametrize("rows, cols", [(128, 4), (130, 5), (1, 1), (300, 17), (256, 8)])
def test_swizzle_matches_documented_offsets(rows: int, cols: int) -> None:
    scale = torch.arange(rows * cols, dtype=torch.float32).remainder(448).reshape(rows, cols)
    scale = scale.to(torch.float8_e4m3fn)
    flat = swizzle_128x4(scale).view(torch.uint8)
    assert flat.numel() == (-(-rows // 128) * 128) * (-(-cols // 4) * 4)
    src = scale.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            assert flat[swizzle_offset(r, c, cols)] == src[r, c], (r, c)
    # padding positions hold zero scales
    used = {swizzle_offset(r, c, cols) for r in range(rows) for c in range(cols)}
    pad = torch.tensor([i for i in range(flat.numel()) if i not in used], dtype=torch.long)
    assert pad.numel() == 0 or bool((flat[pad] == 0).all())


def test_scaled_mm_arguments() -> None:
    a = ds_nvfp4.quantize(torch.randn(200, 48))            # K=48: padded to 64 for cuBLASLt
    b = ds_nvfp4.quantize(torch.randn(40, 48))               # N=40: padded to 48
    args = build_scaled_mm_args(a, b)
    fp4 = torch.float4_e2m1fn_x2
    assert args.a.dtype == fp4 and args.a.shape == (200, 32) and args.a.stride() == (32, 1)
    assert args.b.dtype == fp4 and args.b.shape == (32, 48) and args.b.stride() == (1, 32)  # column-major
    assert args.scale_a.dtype == torch.float8_e4m3fn and args.scale_a.numel() == 256 * 4
    assert args.scale_b.numel() == 128 * 4 and args.n == 40
    assert torch.equal(args.alpha, a.amax * b.amax * torch.tensor(1 / 2688**2))
    # the real codes sit unchanged at the start of the padded row (the padding is zero codes)
    a_data = args.a.view(torch.uint8)[:, :24]
    assert torch.equal(a_data, a.data)


def _cuda(cc, **kw) -> DeviceInfo:
    return DeviceInfo("cuda", kw.pop("name", "GPU"), cc, kw.pop("cuda", "12.9"), "2.13.0",
                      kw.pop("fp4", True), kw.pop("te", None))


@pytest.mark.parametrize(
    "info, requested, want, reason",
    [
        (DeviceInfo("cpu"), None, "emulated", "no CUDA device: CPU"),
        (_cuda((9, 0), name="NVIDIA H200"), None, "emulated", "NVIDIA H200 is sm_90 (Hopper): no FP4 tensor cores"),
        (_cuda((8, 0)), None, "emulated", "no FP4 tensor cores"),
        (_cuda((10, 0)), None, "torch", "Blackwell datacenter"),
        (_cuda((10, 0), te="2.9.0", fp4=False), None, "transformer_engine", "Transformer Engine 2.9.0"),
        (_cuda((12, 0), te="2.9.0"), None, "torch", "TE's RHT and stochastic-rounding kernels fail"),
        (_cuda((10, 0), cuda="12.6", fp4=True), None, "emulated", "CUDA 12.6 < 12.8"),
        (_cuda((10, 0)), "emulated", "emulated", "requested by precision.kernel"),
        (_cuda((10, 3), te="2.10"), "transformer_engine", "transformer_engine", "requested"),
    ],
)
def test_dispatch_decisions(info: DeviceInfo, requested, want: str, reason: str) -> None:
    sel = decide(info, requested)
    assert sel.name == want and reason in sel.reason
    assert sel.describe().startswith(f"kernel: {want} (")


@pytest.mark.parametrize(
    "info, requested, needle",
    [
        (DeviceInfo("cpu"), "torch", "'torch' cannot run here: no CUDA device: CPU"),
        (_cuda((9, 0), name="NVIDIA H100"), "transformer_engine", "sm_90 (Hopper)"),
        (_cuda((10, 0)), "transformer_engine", "Transformer Engine is not installed"),
        (_cuda((10, 0), fp4=False), "torch", "lacks float4_e2m1fn_x2"),
        (DeviceInfo("cpu"), "cutlass", "not a backend"),
    ],
)
def test_unavailable_request_is_an_error(info: DeviceInfo, requested: str, needle: str) -> None:
    with pytest.raises(BackendUnavailable, match=r"precision\.kernel") as e:
        decide(info, requested)
    assert needle in str(e.value)


def test_select_on_this_machine() -> None:
    sel = select(None)
    assert sel.name in ("emulated", "torch", "transformer_engine")
    if not torch.cuda.is_available():
        assert sel.name == "emulated" and "CPU" in sel.reason
        with pytest.raises(BackendUnavailable):
            select("torch")


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10),
                    reason="needs a Blackwell GPU (sm_100+) for the native FP4 GEMM; elsewhere only emulation exists")
@pytest.mark.parametrize("name", ["torch", "transformer_engine"])
def test_native_backends_match_emulation(name: str) -> None:
    from ds_nvfp4.kernels.select import availability, read_device

    ok, why = availability(read_device())[name]
    if not ok:
        pytest.skip(why)
    a = ds_nvfp4.quantize(torch.randn(256, 512, device="cuda"))
    b = ds_nvfp4.quantize(torch.randn(128, 512, device="cuda"), block="16x16")
    want = reference.mm(a, b, torch.float32)
    got = get_backend(name).mm(a, b, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
