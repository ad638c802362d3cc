"""An unmodified PEFT LoRA + Hugging Face Trainer script (nothing of ds_nvfp4 in it), as a user brings it for a
published checkpoint: the model is built from the folder's config (under ``zero.Init``: the ds_config is ZeRO-3),
its weights come from the ds_config's ``precision.base.checkpoint``.

``deepspeed --num_gpus 2 hf_lora_script.py --deepspeed ds.json --base FOLDER --out DIR [--steps N]
[--resume CHECKPOINT] [--targets q_proj,k_proj,...]``, or through launch/*.sh with ``SCRIPT=`` and ``CONFIG=``
(they pass ``--deepspeed_config``). Writes the adapters (PEFT's format) to DIR/adapter and, for the test, each
rank's logged losses, host and storage report to DIR/rank{R}.json.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "shakespeare_sample.txt"
SEQ = 32


class Bytes(torch.utils.data.Dataset):
    def __init__(self, vocab: int) -> None:
        data = torch.tensor(list(FIXTURE.read_bytes()[: 16 * 1024]), dtype=torch.long) % vocab
        self.chunks = data[: len(data) // SEQ * SEQ].view(-1, SEQ)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.chunks[i], "labels": self.chunks[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", "--deepspeed_config", dest="deepspeed", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save_steps", type=int, default=3)
    p.add_argument("--resume", default=None)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=2, max_steps=args.steps,
                              learning_rate=1e-2, warmup_steps=0, lr_scheduler_type="constant", bf16=True,
                              deepspeed=args.deepspeed, use_cpu=True, report_to=[], logging_steps=1,
                              save_strategy="steps", save_steps=args.save_steps, disable_tqdm=True, seed=0,
                              dataloader_num_workers=0)
    config = AutoConfig.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_config(config)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=args.targets.split(",")))
    trainer = Trainer(model=model, args=targs, train_dataset=Bytes(config.vocab_size))
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(str(Path(args.out) / "adapter"))
    probe(trainer, args.out)


def probe(trainer, out: str) -> None:
    """Not part of a user's script: facts for the test."""
    state = getattr(trainer.model_wrapped, "ds_nvfp4", None)
    rank = int(os.environ.get("RANK", "0"))
    import socket

    fact = {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "host": socket.gethostname(), "netns": os.readlink("/proc/self/ns/net"),
            "report": state.store.report().to_dict() if state is not None and state.store is not None else None,
            "notes": state.conversion.notes if state is not None else []}
    Path(out, f"rank{rank}.json").write_text(json.dumps(fact))


if __name__ == "__main__":
    main()
