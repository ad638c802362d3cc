"""An unmodified Accelerate training loop (nothing of ds_nvfp4 in it): ``accelerate launch --config_file
acc.yaml accelerate_script.py --out DIR``, where acc.yaml names a DeepSpeed plugin config with ``precision``."""

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator

from tests.integrations.hf_trainer_script import Bytes, tiny_llama


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(Bytes(), batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))

    # the probe (not part of a user's script): facts for the test
    state = getattr(model, "ds_nvfp4", None)
    rank = int(os.environ.get("RANK", "0"))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "has_state": state is not None, "losses": losses,
        "report": state.store.report().to_dict() if state is not None and state.store is not None else None,
        "conversion": state.conversion.to_dict() if state is not None else None}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
