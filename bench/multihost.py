"""ZeRO-3 across emulated hosts on rate-limited links: BF16 vs packed NVFP4 with BF16 or NVFP4 gathers.

    sudo .venv/bin/python bench/multihost.py --hosts 2 4 --rates 0 1000 200 50 --model 20m \
        --out docs/evidence/scaling/multihost.json          # ~40 min on 2 cores; resumable; needs root

For each host count it builds that many network-namespace hosts on one switch (tests/cluster/hosts.py: veth pairs
to a bridge, one sshd per host), and for each rate shapes every host's link to it with ``tc tbf`` in both directions
(0: unshaped). For each configuration it launches one rank per host the way users launch (``deepspeed --hostfile``
over pdsh, from the first host) running this file's worker: the reference GPT (``--model``), random tokens,
``--warmup`` steps, then ``--steps`` measured steps. Per run it records the median step time, tokens/s, the bytes
each collective moved per step and rank (counted by wrapping torch.distributed: bench/comm_count.py), the bytes the
host's NIC sent (/proc/net/dev) and the analytic bytes (ds_nvfp4.zero.traffic). Results are appended to ``--out``
as each run ends (a finished run is skipped when the bench is started again). Namespaces, sshds and qdiscs are
removed at the end and after a failure or Ctrl-C.

Configurations (each pins its gather and reduce-scatter precision: :data:`CONFIGS`, checked by
tests/test_bench_configs.py): ``bf16`` (ds_configs/bf16_zero3.json), ``nvfp4_bf16_gather``
(ds_configs/nvfp4_zero3.json: packed storage, all_gather "bf16"), ``nvfp4_nvfp4_gather`` (all_gather "nvfp4"),
``nvfp4_fp32_rs`` (NVFP4 gathers, reduce_scatter "fp32"), ``hpz`` (plain BF16 with ZeRO++ hpZ, a secondary
partition per host) and ``qwz`` (plain BF16 with ZeRO++ qwZ: CUDA only, refused on CPU). Every NVFP4
configuration runs FP4 from the first step (the presets' BF16
warm-up removed), with a micro-batch of ``--micro`` sequences of ``--seq`` tokens, and with
``stage3_max_reuse_distance: 0`` (gathered weights released after each use, as in any model of 1B+ parameters).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_nvfp4.config import with_overrides  # noqa: E402

#: every configuration pins its gather and reduce-scatter precision, whatever the preset's defaults are (the
#: packed presets gather NVFP4 since issue 20; a configuration named "bf16_gather" must not inherit that)
CONFIGS: dict[str, tuple[str, dict]] = {
    "bf16": ("bf16_zero3.json", {}),
    "nvfp4_bf16_gather": ("nvfp4_zero3.json", {"precision.communication.all_gather": "bf16",
                                               "precision.communication.reduce_scatter": "bf16"}),
    "nvfp4_nvfp4_gather": ("nvfp4_zero3.json", {"precision.communication.all_gather": "nvfp4",
                                                "precision.communication.reduce_scatter": "bf16"}),
    "nvfp4_fp32_rs": ("nvfp4_zero3.json", {"precision.communication.all_gather": "nvfp4",
                                           "precision.communication.reduce_scatter": "fp32",
                                           "communication_data_type": "fp32"}),
    # ZeRO++: qwZ (INT8 weight gathers) needs DeepSpeed's CUDA quantizer (refused on CPU: docs/evidence/scaling/
    # qwz_cpu.txt; modelled in bench/cluster_model.py); hpZ (a secondary weight partition within each node, so the
    # backward gathers stay on the node) runs here: one rank per host, so each rank's secondary partition is the
    # whole model and the backward gather moves nothing across hosts
    "qwz": ("bf16_zero3.json", {"zero_optimization.zero_quantized_weights": True}),
    "hpz": ("bf16_zero3.json", {"zero_optimization.zero_hpz_partition_size": 1}),
}


def pinned(name: str, cfg: dict) -> dict:
    """What configuration ``name`` gathers and reduce-scatters in, read from its ds_config: ``{"all_gather": ...,
    "reduce_scatter": ..., "zeropp": ...}`` (the test that each configuration runs what its name says)."""
    comm = cfg.get("precision", {}).get("communication", {}) if cfg.get("precision", {}).get("enabled") else {}
    zero = cfg["zero_optimization"]
    return {"all_gather": comm.get("all_gather", "bf16"), "reduce_scatter": comm.get("reduce_scatter", "bf16"),
            "zeropp": [k for k in ("zero_quantized_weights", "zero_hpz_partition_size") if zero.get(k)]}
LIVE = 3_000_000  # stage3_max_live_parameters and stage3_prefetch_bucket_size of every run (see ds_config)
RUN_TIMEOUT = 900  # one launched job: DeepSpeed start + warm-up + measured steps at the slowest rate


def ds_config(name: str, micro: int) -> dict:
    """The ds_config of configuration ``name``: the preset, its overrides, FP4 from step 1, ``micro`` per rank."""
    preset, overrides = CONFIGS[name]
    cfg = json.loads((ROOT / "ds_configs" / preset).read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg.get("precision", {}).pop("schedule", None)
    # gathers of ~1.3 blocks at a time (per layer, as in a model of 1B+) instead of the whole 20M model in one
    # prefetch; DeepSpeed still keeps each gathered weight until the backward (its reuse distance, 1e9 elements,
    # spans this model), so every weight is gathered once per step: bench/gather_passes.py, docs/scaling.md
    cfg["zero_optimization"].update(stage3_max_live_parameters=LIVE, stage3_prefetch_bucket_size=LIVE)
    return with_overrides(cfg, overrides)


def nic_bytes(iface: str) -> tuple[int, int]:
    """(received, sent) bytes of ``iface`` in this process's network namespace (/proc/self/net/dev)."""
    for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        name, data = line.split(":", 1)
        if name.strip() == iface:
            f = data.split()
            return int(f[0]), int(f[8])
    return 0, 0


# ---------------------------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    from bench import comm_count

    comm_count.install()  # before DeepSpeed builds its backend (it captures the gather/scatter functions)
    import deepspeed
    import torch
    import torch.nn.functional as F

    import ds_nvfp4
    from ds_nvfp4.evaluation.gpt import GPT, model_spec
    from ds_nvfp4.zero.traffic import engine_traffic

    t_start = time.monotonic()
    deepspeed.init_distributed(dist_backend="gloo")
    t_init = time.monotonic()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = ds_config(args.config, args.micro)
    torch.manual_seed(0)
    model = GPT.from_spec(model_spec(args.model), args.seq)
    engine, *_ = ds_nvfp4.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    t_engine = time.monotonic()
    state = getattr(engine, "ds_nvfp4", None)
    n_params = sum(p.ds_numel for p in engine.module.parameters())
    fp4 = state.conversion.fp4_params if state is not None else 0
    analytic = engine_traffic(engine)
    g = torch.Generator().manual_seed(1000 + rank)
    ends, counted, nic = [], {}, (0, 0)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torch.distributed.barrier()
            comm_count.reset()
            nic = nic_bytes(args.iface)
            ends.append(time.perf_counter())
        idx = torch.randint(0, 256, (args.micro, args.seq + 1), generator=g)
        logits = engine(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        if step >= args.warmup:
            ends.append(time.perf_counter())
    counted = comm_count.by_family()
    rx, tx = (a - b for a, b in zip(nic_bytes(args.iface), nic))
    steps = [b - a for a, b in itertools.pairwise(ends)]
    mine = {"rank": rank, "host": os.uname().nodename, "step_s": steps, "nic_tx_bytes_per_step": tx / args.steps,
            "nic_rx_bytes_per_step": rx / args.steps, "init_distributed_s": t_init - t_start,
            "initialize_s": t_engine - t_init,
            "counted_per_step": {f: {k: v / args.steps for k, v in c.items()} for f, c in counted.items()}}
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    if rank == 0:
        med = statistics.median(s for r in every for s in r["step_s"][:])
        slowest = max(statistics.median(r["step_s"]) for r in every)
        out = {"config": args.config, "model": args.model, "params": n_params, "fp4_params": fp4, "world": world,
               "seq": args.seq, "micro": args.micro, "steps": args.steps, "warmup": args.warmup,
               "step_s": slowest, "step_s_all_ranks_median": med,
               "tokens_per_s": world * args.micro * args.seq / slowest,
               "analytic_per_step": analytic.as_dict(), "ranks": every,
               "wire_share": {f: comm_count.wire_share(f, world) for f in comm_count.FAMILY.values()},
               "ds_config": cfg}
        Path(args.result).write_text(json.dumps(out, indent=1))
    torch.distributed.barrier()


# ------------------------------------------------------------------------------------------------ orchestrator
def launch(cluster, hostfile: Path, name: str, args: argparse.Namespace, result: Path) -> dict:
    """Run configuration ``name`` with one rank per host (deepspeed --hostfile over pdsh, started on host 1)."""
    from tests.cluster.hosts import IFACE

    env_file = cluster.root / "deepspeed_env"
    bin_dir = ROOT / ".venv" / "bin"
    ext = os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache/torch_extensions")
    env_file.write_text(f"PATH={bin_dir}:{os.environ['PATH']}\nPYTHONPATH={ROOT}\nOMP_NUM_THREADS=1\n"
                        f"GLOO_SOCKET_IFNAME={IFACE}\nDS_ACCELERATOR=cpu\nTORCH_EXTENSIONS_DIR={ext}\n")
    result.unlink(missing_ok=True)
    cmd = (f"cd {ROOT} && DS_ENV_FILE={env_file} timeout {RUN_TIMEOUT} {bin_dir}/deepspeed --hostfile {hostfile} "
           f"--launcher pdsh --master_addr {cluster.hosts[0].name} --master_port 29533 bench/multihost.py --worker "
           f"--config {name} --model {args.model} --seq {args.seq} --micro {args.micro} --steps {args.steps} "
           f"--warmup {args.warmup} --iface {IFACE} --result {result}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    r = cluster.hosts[0].run(cmd, timeout=RUN_TIMEOUT + 60, env={**env, "DS_ACCELERATOR": "cpu"})
    log = r.stdout + r.stderr
    (cluster.root / f"{name}.log").write_text(log)
    if r.returncode != 0 or not result.exists():
        tail = "\n".join(line for line in log.splitlines() if "Error" in line or "error" in line)[-1500:]
        return {"config": name, "error": f"exit {r.returncode}: {tail or log[-1500:]}"}
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rates", type=float, nargs="+", default=[0, 1000, 200, 50],
                    help="link rates in Mbit/s per direction (0: unshaped)")
    ap.add_argument("--configs", nargs="+", default=["bf16", "hpz", "nvfp4_bf16_gather", "nvfp4_nvfp4_gather"],
                    choices=list(CONFIGS))
    ap.add_argument("--model", default="20m")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "multihost.json")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ds-nvfp4-multihost"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--iface", default="lo", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from tqdm import tqdm

    from tests.cluster.hosts import Cluster, requirements

    why = requirements("sshd", "ssh", "pdsh", "tc")
    if why:
        raise SystemExit(f"bench/multihost.py: {why}")
    done = json.loads(args.out.read_text()) if args.out.exists() else []
    key = lambda r: (r["world"], r["rate_mbit"], r["config"])  # noqa: E731
    finished = {key(r) for r in done if "error" not in r}
    todo = [(n, rate, c) for n in args.hosts for rate in args.rates for c in args.configs
            if (n, rate, c) not in finished]
    bar = tqdm(total=len(todo), desc="multi-host runs", unit="run")
    for n in args.hosts:
        mine = [t for t in todo if t[0] == n]
        if not mine:
            continue
        shutil.rmtree(args.workdir, ignore_errors=True)
        with Cluster(args.workdir, tuple(f"h{i + 1}" for i in range(n))) as c:
            hostfile = c.root / "hostfile"
            hostfile.write_text("".join(f"{h.name} slots=1\n" for h in c.hosts))
            for rate in args.rates:
                runs = [cfg for (m, r, cfg) in mine if r == rate]
                if not runs:
                    continue
                c.shape(rate or None)
                for cfg in runs:
                    bar.set_postfix_str(f"{n} hosts, {rate:g} Mbit/s, {cfg}")
                    t0 = time.monotonic()
                    res = launch(c, hostfile, cfg, args, c.root / "result.json")
                    res.update(world=n, rate_mbit=rate, config=cfg, wall_s=round(time.monotonic() - t0, 1),
                               qdisc=c.qdiscs()[0])
                    done = [r for r in done if key(r) != key(res)] + [res]
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(done, indent=1))
                    msg = res.get("error") or f"{res['step_s']:.2f} s/step, {res['tokens_per_s']:.0f} tokens/s"
                    tqdm.write(f"{n} hosts {rate:6g} Mbit/s {cfg:20s} {msg}")
                    bar.update()
    bar.close()
    print(f"results: {args.out} (tables and plots: python bench/scaling_report.py {args.out})")


if __name__ == "__main__":
    main()
