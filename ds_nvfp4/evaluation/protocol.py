"""Reference training protocols: the recipe every run of an evidence set shares, fixed before the runs.

A protocol names what ``launch/train.py`` would otherwise take from flags (batch, steps, warm-up, peak learning
rate, the learning-rate floor, the evaluations) so that the runs a claim rests on cannot differ in them, and it
fixes the final evaluation in advance: the whole validation split, evaluated once at the end of training and
written to ``final_eval.json``. ``config.json`` records the protocol, and ``ds-nvfp4 compare`` refuses runs of
different protocols.

``v1`` is the recipe of the evidence before issue 36 (its BF16 seeds end 0.4-2.6% apart); ``v2`` the low-noise
protocol measured in docs/results.md ("Reference protocol").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Protocol:
    """One reference recipe. Batches are per rank; the global batch is ``micro_batch x ranks`` sequences."""

    name: str
    micro_batch: int        #: sequences per rank per step (replaces the ds_config's train_micro_batch_size_per_gpu)
    steps: int              #: optimizer steps
    warmup: int             #: linear warm-up steps from lr/warmup to the peak
    lr: float               #: peak learning rate (replaces the ds_config optimizer's lr)
    lr_floor: float         #: the cosine decay ends at lr_floor x lr
    eval_interval: int      #: steps between the training's evaluations
    eval_batches: int       #: held-out batches per training evaluation (micro_batch sequences each, per rank)
    final_eval: bool = True  #: evaluate the whole validation split after the last step (final_eval.json)

    def to_dict(self) -> dict:
        return asdict(self)


PROTOCOLS: dict[str, Protocol] = {
    p.name: p for p in (
        # the evidence before issue 36: batch 8 x 256 bytes, a 30-step warm-up, cosine to 10%
        Protocol("v1", micro_batch=4, steps=2100, warmup=30, lr=1e-3, lr_floor=0.1, eval_interval=100,
                 eval_batches=32, final_eval=False),
        # issue 36, first candidate: 4x the batch (32 x 256 bytes), a 10% warm-up and a cosine decay to zero; its
        # 5M BF16 seeds 0-2 end 0.60% apart on the whole split (docs/evidence/protocol)
        Protocol("v2", micro_batch=16, steps=1200, warmup=120, lr=1e-3, lr_floor=0.0, eval_interval=100,
                 eval_batches=8),
        # issue 36, second candidate: 8x the batch (64 x 256 bytes, 19.7M tokens: ~4.4 epochs), twice the peak
        # learning rate, so the early plateau ends sooner and the runs converge further before the decay ends
        Protocol("v3", micro_batch=32, steps=1200, warmup=100, lr=2e-3, lr_floor=0.0, eval_interval=100,
                 eval_batches=4),
    )
}


def whole_split_batches(val_bytes: int, micro_batch: int, seq: int) -> int:
    """Batches of ``micro_batch`` windows of ``seq`` bytes that tile a validation split of ``val_bytes`` bytes
    without overlap (the windows of :func:`ds_nvfp4.evaluation.gpt.evaluate` are spread with stride >= seq): every
    held-out byte but the last partial window's is predicted once."""
    return max(1, (val_bytes - seq - 1) // (micro_batch * seq))
