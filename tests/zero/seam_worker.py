"""Builds real one-rank engines (ZeRO-3 packed, and a 1-stage PipelineEngine), then removes each declared seam in
turn (attribute deleted, or a callable replaced by one that takes no arguments) and records ``seams.check``'s
error. Prints one JSON line: ``{"intact": error-or-None, "errors": {seam name: message or None}}``."""

from __future__ import annotations

import contextlib
import json
import os

import torch
from torch import nn


def _engines():
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from ds_nvfp4.zero.teardown import destroy_at_exit

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    deepspeed.init_distributed(dist_backend="gloo")
    destroy_at_exit()  # plain deepspeed.initialize below: without it a rank may abort at exit (zero/teardown.py)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,
                                                                                          "torch_adam": True}},
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    pipe = PipelineModule(layers=[LayerSpec(nn.Linear, 32, 32)], num_stages=1, loss_fn=nn.MSELoss())
    cfg1 = {**cfg, "zero_optimization": {"stage": 1}}
    pipe_engine, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), config=cfg1)
    return engine, pipe_engine


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_args() -> None:
    pass


@contextlib.contextmanager
def removed(obj, attr: str, replace: bool):
    """``obj.attr`` gone (from the instance and from every class of its MRO that defines it), or, with ``replace``,
    turned into a callable that takes no parameters (a changed signature)."""
    owners = ([obj] if attr in getattr(obj, "__dict__", {}) else []) + \
        ([] if isinstance(obj, type(os)) else [c for c in type(obj).__mro__ if attr in vars(c)])
    saved = [(o, vars(o)[attr]) for o in owners]
    try:
        if replace:
            first = owners[0]
            setattr(first, attr, staticmethod(_no_args) if isinstance(first, type) else _no_args)
        else:
            for o in owners:
                delattr(o, attr)
        yield
    finally:
        for o, value in saved:
            setattr(o, attr, value)


def main() -> None:
    from ds_nvfp4.zero import seams

    engine, pipe_engine = _engines()
    param = next(engine.module.parameters())
    targets = seams.Targets(engine, engine.optimizer, param)
    pipe_targets = seams.Targets(pipe_engine, pipe_engine.optimizer, None)
    out = {"intact": None, "errors": {}}
    try:
        seams.check(targets, ("engine", "packed"))
        seams.check(pipe_targets, ("engine", "pipeline"))
    except seams.UnsupportedDeepSpeed as exc:
        out["intact"] = str(exc)
    # where each seam lives: (the object to remove it from, the attribute)
    import deepspeed.comm.comm as ds_comm
    import deepspeed.runtime.zero.partition_parameters as pp
    import deepspeed.utils as ds_utils

    where = {
        "engine.global_steps": (engine, "global_steps"), "engine.skipped_steps": (engine, "skipped_steps"),
        "engine.global_samples": (engine, "global_samples"),
        "engine.monitor.write_events": (engine.monitor, "write_events"),
        "engine.checkpoint_engine.is_decoupled": (engine.checkpoint_engine, "is_decoupled"),
        "engine.save_checkpoint": (engine, "save_checkpoint"), "engine.load_checkpoint": (engine, "load_checkpoint"),
        "engine.step": (engine, "step"), "deepspeed.comm.comm.cdb": (ds_comm, "cdb"),
        "engine.train_batch": (pipe_engine, "train_batch"),
        "engine.module._layer_specs": (pipe_engine.module, "_layer_specs"),
        # (stage_id is also read through to the PipelineModule by DeepSpeedEngine.__getattr__: remove grid)
        "engine.stage_id / num_stages / grid.get_data_parallel_rank": (pipe_engine, "grid"),
        "parameter.ds_tensor": (param, "ds_tensor"), "parameter.ds_numel / ds_shape / ds_id / ds_status":
            (param, "ds_id"), "parameter.ds_process_group": (param, "ds_process_group"),
        "parameter.partition_numel": (param, "partition_numel"), "parameter.all_gather": (param, "all_gather"),
        "parameter.all_gather_coalesced": (param, "all_gather_coalesced"), "parameter.partition": (param, "partition"),
        "ZeroParamStatus.NOT_AVAILABLE / INFLIGHT / AVAILABLE": (pp, "ZeroParamStatus"),
        "deepspeed.utils.set_z3_leaf_module": (ds_utils, "set_z3_leaf_module"),
        "deepspeed.utils.z3_leaf_module": (ds_utils, "z3_leaf_module"),
    }
    for s in seams.SEAMS:
        if s.name.startswith("optimizer."):
            where[s.name] = (engine.optimizer, s.name.split(".", 1)[1])
    for s in seams.SEAMS:
        obj, attr = where[s.name]
        t = pipe_targets if s.scope == "pipeline" else targets
        with removed(obj, attr, replace=bool(s.params)):
            try:
                seams.check(t, (s.scope,))
                out["errors"][s.name] = None
            except seams.UnsupportedDeepSpeed as exc:
                out["errors"][s.name] = str(exc)
    print(json.dumps(out))
    os._exit(0)  # skip the process-group teardown (one process, nothing left to write)


if __name__ == "__main__":
    with torch.no_grad():
        main()
