"""An unmodified Hugging Face Trainer script (nothing of ds_nvfp4 in it), as a user brings it.

``deepspeed --num_gpus 2 hf_trainer_script.py --deepspeed ds.json --out DIR [--model_dir SAVED] [--families a,b]``,
or under
``accelerate launch`` with a DeepSpeed plugin config (then without ``--deepspeed``). A tiny Llama built from its
config (or ``from_pretrained`` of a saved one: HF then builds it under ``deepspeed.zero.Init``), byte-level
Shakespeare. After training, the probe at the end writes what the test checks to ``DIR/rank{R}.json``.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "shakespeare_sample.txt"
SEQ = 64


class Bytes(torch.utils.data.Dataset):
    def __init__(self) -> None:
        data = torch.tensor(list(FIXTURE.read_bytes()[: 64 * 1024]), dtype=torch.long)
        self.chunks = data[: len(data) // SEQ * SEQ].view(-1, SEQ)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.chunks[i], "labels": self.chunks[i]}


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--model_dir", default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--families", default=None, help="saved models DIR/<family> to train one after another "
                                                      "(tests/integrations/families.py), each into OUT/<family>")
    args = p.parse_args()
    if args.families:
        for name in args.families.split(","):
            train(args, str(Path(args.out) / name), str(Path(args.model_dir) / name))
        # several engines in one process, left to interpreter exit as a user's script leaves them: ds_nvfp4
        # destroys the gloo groups at exit (zero/teardown.py; without it this process aborted now and then)
        return
    train(args, args.out, args.model_dir)


def train(args, out: str, model_dir: str | None) -> None:
    from transformers import AutoModelForCausalLM

    targs = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=args.steps,
                              learning_rate=3e-3, warmup_steps=0, lr_scheduler_type="constant", bf16=True,
                              deepspeed=args.deepspeed, use_cpu=True, report_to=[], logging_steps=1,
                              save_strategy="steps", save_steps=args.steps, disable_tqdm=True, seed=0,
                              dataloader_num_workers=0)
    torch.manual_seed(0)
    # created after TrainingArguments: with a ZeRO-3 config, from_pretrained builds the model under zero.Init
    model = AutoModelForCausalLM.from_pretrained(model_dir) if model_dir else tiny_llama()
    trainer = Trainer(model=model, args=targs, train_dataset=Bytes())
    trainer.train()
    probe(trainer, model, out)


def probe(trainer, model, out: str) -> None:
    """Not part of a user's script: facts for the test (what the engine is, the losses this rank logged)."""
    engine = trainer.model_wrapped
    state = getattr(engine, "ds_nvfp4", None)
    rank = int(os.environ.get("RANK", "0"))
    fact = {"rank": rank, "has_state": state is not None,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "built_under_zero_init": bool(getattr(model.get_input_embeddings().weight, "ds_id", None) is not None),
            "report": state.store.report().to_dict() if state is not None and state.store is not None else None,
            "conversion": state.conversion.to_dict() if state is not None else None}
    Path(out, f"rank{rank}.json").write_text(json.dumps(fact))
    if state is not None:  # the BF16 weights the forward multiplies, for the export's bit-for-bit check
        import deepspeed

        from ds_nvfp4.nn.module import FP4Module

        fp4 = {(f"{n}.{pname}" if m.kind == "experts" else n): param for n, m in engine.module.named_modules()
               if isinstance(m, FP4Module) for pname, param, _ in m.fp4_weights()}
        with deepspeed.zero.GatheredParameters(list(fp4.values())):
            seen = {n: p.detach().clone() for n, p in fp4.items()}
        if rank == 0:
            torch.save(seen, Path(out, "forward_weights.pt"))


if __name__ == "__main__":
    main()
