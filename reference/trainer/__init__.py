"""GRPO trainer: trajectories in, a new policy version out, handed to engines through a directory.

    batch.py       Trajectory (the rollout -> trainer record), collate to padded tensors, shard_by_group
    advantages.py  group-normalised advantages
    loss.py        token-level clipped surrogate with a dual clip, k3 KL, entropy bonus (exact formula)
    trainer.py     Trainer: micro-batches, global token mean, AdamW, gradient clipping, metrics
    parallel.py    data parallelism: gloo all-reduce on CPU, FSDP on GPUs
    handoff.py     versioned, atomic weight publication in the engines' checkpoint format
    checkpoint.py  resumable checkpoints (bit-identical continuation)
    config.py      TrainerConfig; recipe.py: MathRecipe (model size + batch shape + TrainerConfig)
    probe.py       in-process learnability probe (sampler, grading, training loop)

Pure torch: nothing here imports Ray or talks HTTP.
"""
