"""How many times ZeRO-3 gathers each weight per step: the bytes of the forward's and the backward's gathers.

    deepspeed --num_gpus 2 bench/gather_passes.py --config bf16 --model 20m
    deepspeed --num_gpus 2 bench/gather_passes.py --config bf16 --model 20m --zero '{"stage3_max_reuse_distance": 0}'

Runs bench/multihost.py's configuration on local ranks and prints, for 4 steps, the all-gather payload of the
forward, of the backward (and the reduce-scatter) per rank, counted by wrapping torch.distributed (comm_count.py).
A weight DeepSpeed keeps gathered from its forward to its backward (within ``stage3_max_reuse_distance``, under
``stage3_max_live_parameters``) is gathered once per step, not twice.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import comm_count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bf16")
    ap.add_argument("--model", default="20m")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--zero", default="{}", help="zero_optimization overrides (JSON)")
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    comm_count.install()
    import deepspeed
    import torch
    import torch.nn.functional as F

    import ds_nvfp4
    from bench.multihost import ds_config
    from ds_nvfp4.evaluation.gpt import GPT, model_spec

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = ds_config(args.config, 1)
    cfg["zero_optimization"].update(json.loads(args.zero))
    torch.manual_seed(0)
    model = GPT.from_spec(model_spec(args.model), args.seq)
    engine, *_ = ds_nvfp4.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    mb = lambda f, k: f.get(k, {}).get("bytes", 0) / 1e6  # noqa: E731
    for step in range(4):
        idx = torch.randint(0, 256, (1, args.seq + 1))
        comm_count.reset()
        logits = engine(idx[:, :-1])
        fwd = comm_count.by_family()
        comm_count.reset()
        engine.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)))
        bwd = comm_count.by_family()
        engine.step()
        if torch.distributed.get_rank() == 0:
            print(f"step {step}: forward all-gather {mb(fwd, 'all_gather'):.1f} MB, backward all-gather "
                  f"{mb(bwd, 'all_gather'):.1f} MB, reduce-scatter {mb(bwd, 'reduce_scatter'):.1f} MB "
                  f"({args.config}, zero_optimization overrides {args.zero})", flush=True)


if __name__ == "__main__":
    main()
