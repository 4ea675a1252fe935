"""Weight hand-off (the built-in engine loads what the trainer publishes) and exact resume."""

from __future__ import annotations

import asyncio

import pytest
import torch

from reference.engine.builtin import BuiltinEngine
from reference.model import load_checkpoint
from reference.trainer import handoff
from reference.trainer.batch import Trajectory
from reference.trainer.config import TrainerConfig
from reference.trainer.handoff import latest_version, publish_weights, version_dir
from reference.trainer.trainer import Trainer


def batch_for(trainer: Trainer, n_groups: int = 2, group_size: int = 3) -> list[Trajectory]:
    """Random trajectories drawn from the trainer's own RNGs (so a resumed run must restore them)."""
    out = []
    for g in range(n_groups):
        prompt = [trainer.rng.randrange(5, 22) for _ in range(3)]
        for _ in range(group_size):
            answer = torch.randint(5, 22, (3,), generator=trainer.generator).tolist()
            logprobs = (-torch.rand(3, generator=trainer.generator) * 4).tolist()
            reward = float(torch.rand((), generator=trainer.generator))
            out.append(Trajectory(prompt + answer, (0, 0, 0, 1, 1, 1), logprobs, (trainer.version,) * 3, g, reward))
    return out


def test_the_builtin_engine_loads_a_published_version(make_model, task_tok, tmp_path):
    trainer = Trainer(make_model(0), TrainerConfig(), pad_id=0)
    trainer.train_step(batch_for(trainer))
    published = trainer.publish(tmp_path / "weights", tokenizer=task_tok)
    assert published.path == version_dir(tmp_path / "weights", 1)
    assert published.seconds > 0
    assert published.bytes > 0

    async def update(engine: BuiltinEngine):
        await engine.pause()
        await engine.update_weights(published.version, str(published.path))
        await engine.resume()
        return await engine.stats()

    with BuiltinEngine(make_model(5), max_batch=2) as engine:
        stats = asyncio.run(update(engine))
        for (name, p), q in zip(engine.model.state_dict().items(), trainer.model.state_dict().values(), strict=True):
            assert torch.equal(p, q), name
    assert stats.version == 1


def test_a_published_version_is_a_complete_checkpoint(make_model, task_tok, tmp_path):
    trainer = Trainer(make_model(0), TrainerConfig(), pad_id=0)
    published = trainer.publish(tmp_path, tokenizer=task_tok)
    model, tok = load_checkpoint(published.path)
    assert tok.vocab_size == task_tok.vocab_size
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), trainer.model.parameters(), strict=True))
    assert sorted(f.name for f in published.path.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip


def test_publishing_is_atomic_and_tracks_the_latest_version(make_model, tmp_path, monkeypatch):
    model = make_model(0)
    state = model.state_dict()
    assert latest_version(tmp_path) is None
    publish_weights(state, model.config, tmp_path, 3)
    publish_weights(state, model.config, tmp_path, 3)  # a resumed run repeats a version: replaced
    assert latest_version(tmp_path) == 3

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(handoff, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        publish_weights(state, model.config, tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "v00000003"]
    assert latest_version(tmp_path) == 3


def test_resuming_from_a_checkpoint_is_bit_identical(make_model, tmp_path):
    """N steps straight == K steps, checkpoint, a new trainer from disk, N - K steps."""
    config = TrainerConfig(checkpoint_every_steps=2, micro_batch_size=4, seed=11)
    straight = Trainer(make_model(0), config, pad_id=0, checkpoint_dir=tmp_path / "a")
    for _ in range(4):
        straight.train_step(batch_for(straight))

    first = Trainer(make_model(0), config, pad_id=0, checkpoint_dir=tmp_path / "b")
    for _ in range(2):
        first.train_step(batch_for(first))
    del first
    resumed = Trainer.from_checkpoint(tmp_path / "b" / "step-00000002")
    assert resumed.step == 2
    for _ in range(2):
        resumed.train_step(batch_for(resumed))

    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert straight.rng.random() == resumed.rng.random()
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-00000002", "step-00000004"]


def test_checkpoint_restores_optimizer_moments(make_model, tmp_path):
    trainer = Trainer(make_model(0), TrainerConfig(seed=3), pad_id=0)
    trainer.train_step(batch_for(trainer))
    path = trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = Trainer.from_checkpoint(path)
    a, b = trainer.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k]["exp_avg_sq"], b[k]["exp_avg_sq"]) for k in a)
    assert resumed.config == trainer.config


def test_loading_a_directory_without_state_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a trainer checkpoint: no trainer_state.pt"):
        Trainer.from_checkpoint(tmp_path)
