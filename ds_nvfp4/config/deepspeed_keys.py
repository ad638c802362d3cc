"""Top-level ds_config keys DeepSpeed 0.19 reads (from its runtime/constants.py and the config docs).

Only used to suggest a correction for a near-miss (``zero_optimisation``): DeepSpeed itself ignores
unknown top-level keys silently.
"""

DEEPSPEED_TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "wall_clock_breakdown", "dump_state", "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "amp",
    "torch_autocast", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
    "communication_data_type", "seq_parallel_communication_data_type", "sparse_gradients",
    "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "activation_checkpointing", "aio", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "elasticity", "autotuning", "compression_training", "data_efficiency", "curriculum_learning",
    "checkpoint", "data_types", "pipeline", "pld", "eigenvalue", "quantize_training", "hybrid_engine",
    "nebula", "compile", "timers", "memory_breakdown", "disable_allgather", "sparse_attention",
    "dataloader_drop_last", "load_universal_checkpoint", "use_node_local_storage", "graph_harvesting",
    "use_data_before_expert_parallelism", "weight_quantization", "tensor_parallel", "sequence_parallel_size",
    "gradient_allreduce_op", "disable_python_gc", "managed_gradient_accumulation", "mics_shard_size",
    "mics_hierarchical_params_gather", "zenflow", "train_batch_size_per_gpu",
})
