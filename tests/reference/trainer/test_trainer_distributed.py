"""Data parallelism: 2 gloo processes on their own shards train exactly like 1 process on the union.

The union batch has groups of different sizes and lengths, so the two ranks hold different numbers of
generated tokens: a mean of per-rank means would differ from the global token mean the trainer uses.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reference.model import build_model, tiny_config
from reference.trainer.batch import Trajectory, shard_by_group
from reference.trainer.config import TrainerConfig
from reference.trainer.parallel import DataParallel, init_process_group
from reference.trainer.trainer import Trainer

STEPS = 2
CONFIG = TrainerConfig(micro_batch_size=3, seed=5)


def model():
    config = tiny_config(22, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=64)  # fmt: skip
    return build_model(config, seed=1)


def union_batch(step: int) -> list[Trajectory]:
    rng = random.Random(step)
    out = []
    for group, size in enumerate((2, 5, 3, 4)):
        prompt = [rng.randrange(5, 22) for _ in range(rng.randint(2, 5))]
        for _ in range(size):
            n = rng.randint(1, 6)
            ids = prompt + [rng.randrange(5, 22) for _ in range(n)]
            logprobs = [-rng.uniform(0.5, 4) for _ in range(n)]
            out.append(Trajectory(ids, [0] * len(prompt) + [1] * n, logprobs, [step] * n, group, rng.random()))
    return out


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", f"file://{init_file}", rank, world_size)
    try:
        trainer = Trainer(model(), CONFIG, pad_id=0, parallel=DataParallel.from_process_group())
        metrics = [trainer.train_step(shard_by_group(union_batch(s), rank, world_size)) for s in range(STEPS)]
        torch.save({"state": trainer.model.state_dict(), "metrics": [m.to_dict() for m in metrics]},
                   f"{out_dir}/rank{rank}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_one_process_on_the_union_batch(tmp_path):
    shards = [shard_by_group(union_batch(0), r, 2) for r in range(2)]
    assert sum(t.num_generated for t in shards[0]) != sum(t.num_generated for t in shards[1])
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    single = Trainer(model(), CONFIG, pad_id=0)
    expected = [single.train_step(union_batch(s)) for s in range(STEPS)]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    for name, value in single.model.state_dict().items():
        assert torch.equal(ranks[0]["state"][name], ranks[1]["state"][name]), name
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for got, want in zip(ranks[0]["metrics"], expected, strict=True):
        assert got["tokens"] == want.tokens
        assert got["sequences"] == want.sequences
        assert got["loss"] == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-5)
        assert got["entropy"] == pytest.approx(want.entropy, rel=1e-5)


def test_data_parallel_needs_an_initialised_process_group():
    with pytest.raises(ValueError, match="needs torch.distributed initialised first"):
        DataParallel(rank=0, world_size=2)
    with pytest.raises(ValueError, match="unknown backend 'mpi'; choose one of \\['gloo', 'nccl'\\]"):
        init_process_group("mpi", "file:///nonexistent", 0, 1)


def _fsdp_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    init_process_group("nccl", f"file://{init_file}", rank, world_size)
    try:
        trainer = Trainer(model().cuda(), CONFIG, pad_id=0, parallel=DataParallel.from_process_group(fsdp=True))
        for s in range(STEPS):
            trainer.train_step(shard_by_group(union_batch(s), rank, world_size))
        state = trainer.parallel.full_state_dict(trainer.model)
        if rank == 0:
            torch.save(state, f"{out_dir}/fsdp.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_fsdp_on_gpus_matches_one_cpu_process(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    world_size = min(2, torch.cuda.device_count())
    mp.spawn(_fsdp_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path)), nprocs=world_size, join=True)
    single = Trainer(model(), CONFIG, pad_id=0)
    for s in range(STEPS):
        single.train_step(union_batch(s))
    got = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    for name, value in single.model.state_dict().items():
        torch.testing.assert_close(got[name].cpu(), value, rtol=1e-3, atol=1e-4, msg=name)
