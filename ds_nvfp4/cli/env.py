"""`ds-nvfp4 env [--config FILE] [--json]`: the environment check (exit 1 when the config cannot run here)."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="does this node run NVFP4 natively, and if not, why",
                       description="Exit 0: ok (and the --config precision can run here); 1: it cannot.")
    p.add_argument("--config", help="a ds_config whose precision section must be able to run here")
    p.add_argument("--model", help="with --config: the ZeRO-3 bytes per step of this model (reference preset or "
                                   "Hugging Face model directory / config.json)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..envcheck import check_environment

    if args.model and not args.config:
        from ._common import bad_input

        return bad_input("env", ValueError("--model needs --config (the ds_config whose traffic to state)"))
    rep = check_environment(args.config)
    ok = rep.get("config", {}).get("runs_here", True)
    if args.model and ok:
        from ..config import load_config
        from ._common import bad_input, model_traffic

        ds, pc = load_config(args.config)
        try:
            t, label = model_traffic(args.model, ds, pc)
        except (ValueError, OSError) as exc:
            return bad_input("env", exc)
        rep["config"]["traffic"] = {"model": label, **t.as_dict(), "summary": t.describe()}
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0 if ok else 1
    hw, sw = rep["hardware"], rep["software"]
    print(f"node {rep['node']}")
    print(f"  hardware   {hw['name']} ({hw['device']})"
          + (f", sm {hw['compute_capability']}, {hw['memory_gib']} GiB x {hw['gpus']}" if hw["device"] == "cuda"
             else f", {hw.get('threads')} threads, BF16 GEMMs: {hw['bf16_gemm']}"))
    print(f"  FP4 cores  {'yes' if hw['fp4_tensor_cores'] else 'no'}: {hw['fp4_reason']}")
    ds_note = "" if sw["deepspeed_in_tested_range"] else f" (OUTSIDE the tested range {sw['deepspeed_tested_range']})"
    te = sw["transformer_engine"]
    te_note = (f" (signatures of {sw['transformer_engine_tested_range']} followed)"
               if sw["transformer_engine_in_tested_range"] else
               f" (OUTSIDE {sw['transformer_engine_tested_range']}: its NVFP4 API may differ; the start-up GEMM "
               "check decides)") if te else ""
    print(f"  software   python {sw['python']}, torch {sw['torch']} (CUDA {sw['torch_cuda']}), deepspeed "
          f"{sw['deepspeed']}{ds_note}, transformer-engine {te or 'not installed'}{te_note}")
    print(f"  comm       gloo {'yes' if sw['gloo'] else 'no'}, nccl {'yes' if sw['nccl'] else 'no'}"
          f"{' ' + sw['nccl_version'] if sw['nccl_version'] else ''}, mpi4py {sw['mpi']['mpi4py'] or 'not installed'}"
          f"{' (' + sw['mpi']['library'] + ')' if sw['mpi']['library'] else ''}")
    print(f"  kernel     null picks {rep['default_kernel']['name']}: {rep['default_kernel']['reason']}")
    print("  smoke test (quantize + 128x64x256 FP4 GEMM vs the dequantized operands multiplied in float64):")
    for row in rep["smoke_test"]:
        if row["available"]:
            print(f"    {row['backend']:18s} ok  {row['ms']:8.3f} ms  matches the reference: "
                  f"{row['matches_reference']}, rel. error vs FP32 {row['rel_error_vs_fp32']:.3f}"
                  + (f"\n    {'':18s}     {row['operand']}" if row.get("operand") else ""))
        else:
            print(f"    {row['backend']:18s} --  {row['reason']}")
    fk = rep["format_kernels"]
    n_eager = len(fk["eager_fallbacks"])
    state = ("eager" if not fk["compiled"] else "compiled (Inductor), each verified bit-for-bit against eager"
             + (f"; {n_eager} fell back (below)" if n_eager else ""))
    print(f"  format     CPU quantize kernels {state}; DS_NVFP4_COMPILE={fk['policy']}, ATen {fk['cpu_capability']}")
    cpp = ("C++ kernels (csrc/nvfp4_cpu.cpp), verified against eager" if fk["cpp_kernels"]
           else f"no C++ kernels: {fk['cpp_kernels_reason']}")
    print(f"    encode/decode: {cpp}")
    for name, why in fk["eager_fallbacks"].items():
        print(f"    {name}: fell back ({'to Inductor' if name.endswith('(C++)') else 'to eager'}): {why}")
    if "allocator" in rep:
        al = rep["allocator"]
        state = (f"reuses freed buffers ({al['fresh_faults']} page faults and {al['fresh_ms']:.1f} ms to write a "
                 f"fresh 64 MiB tensor, "
                 f"{al['reused_ms']:.1f} ms a reused one)" if al["reuses"] else f"SLOW: {al['advice']}")
        print(f"  allocator  {al['name']}: {state}")
    if "config" in rep:
        c = rep["config"]
        print(f"  config     {c['file']}: {'OK' if c['runs_here'] else 'CANNOT RUN'}: {c['reason']}")
        if "traffic" in c:
            print(f"  traffic    ZeRO-3 per optimizer step and rank ({c['traffic']['model']}): "
                  f"{c['traffic']['summary']}")
    return 0 if ok else 1
