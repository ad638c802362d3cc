"""Evaluation tooling, apart from the training runtime: ``import ds_nvfp4`` loads none of it (tested).

``data`` (the offline corpus), ``gpt`` (the reference model of launch/train.py), ``finetune`` and ``linear_probe``
(downstream checks of a pretrained run) and ``acceptance`` (the BF16-vs-NVFP4 report of ``ds-nvfp4 compare``).
It depends on the runtime, never the reverse.
"""
