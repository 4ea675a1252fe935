"""`drop_zero_advantage_groups`: a group whose advantages are all 0 is left out of the step (no forward or backward
pass, and its tokens out of the token mean), which is the step on the batch without it; reported in the metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reference.trainer.batch import Trajectory
from reference.trainer.config import TrainerConfig
from reference.trainer.trainer import Trainer


def group(name: str, rewards, length: int = 4, first: int = 3) -> list[Trajectory]:
    out = []
    for k, reward in enumerate(rewards):
        ids = tuple(first + (k + j) % 15 for j in range(length + 2))
        out.append(Trajectory(ids, (0, 0) + (1,) * length, (-2.5,) * length, (0,) * length, name, float(reward)))
    return out


SIGNAL = group("a", [1.0, 0.0, 0.5], length=3) + group("b", [0.2, 0.9], length=5, first=7)
SILENT = group("c", [1.0, 1.0, 1.0], length=6, first=4) + group("d", [0.0, 0.0], length=2, first=9)


class _Counting(Trainer):
    rows = 0

    def _micro_step(self, batch, total_tokens):
        self.rows += len(batch.advantages)
        return super()._micro_step(batch, total_tokens)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_dropping_silent_groups_is_the_step_without_them(make_model, entropy_coef):
    """With an entropy bonus the silent groups would have a gradient of their own; dropped, they have none, and
    the token mean is over the other groups' tokens."""
    base = TrainerConfig(entropy_coef=entropy_coef, grad_clip=0.0, micro_batch_size=2)
    dropping = _Counting(make_model(0), dataclasses.replace(base, drop_zero_advantage_groups=True), pad_id=0)
    without = Trainer(make_model(0), base, pad_id=0)
    keeping = Trainer(make_model(0), base, pad_id=0)
    got = dropping.train_step(SIGNAL + SILENT)
    want = without.train_step(SIGNAL)
    kept = keeping.train_step(SIGNAL + SILENT)
    assert dropping.rows == len(SIGNAL)  # no forward pass for the silent groups
    assert (got.dropped_groups, got.dropped_sequences) == (2, 5)
    assert (kept.dropped_groups, kept.dropped_sequences) == (0, 0)
    assert got.tokens == want.tokens == 3 * 3 + 2 * 5 and kept.tokens == got.tokens + 3 * 6 + 2 * 2
    assert got.sequences == kept.sequences == 10  # every sample of the step, dropped ones included
    assert got.reward_mean == pytest.approx(kept.reward_mean)
    for field in ("loss", "pg_loss", "entropy", "grad_norm", "clip_fraction"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-5, abs=1e-7), field
    for p, q in zip(dropping.model.parameters(), without.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    assert got.loss != pytest.approx(kept.loss, rel=1e-3)  # the silent groups' tokens diluted the mean


def test_a_group_with_signal_keeps_its_zero_advantage_samples(make_model):
    """Under negative_weight 0 the below-mean samples have advantage 0, but their group has signal: it stays."""
    config = TrainerConfig(drop_zero_advantage_groups=True, negative_weight=0.0)
    trainer = _Counting(make_model(0), config, pad_id=0)
    metrics = trainer.train_step(SIGNAL)
    assert (metrics.dropped_groups, metrics.dropped_sequences, trainer.rows) == (0, 0, len(SIGNAL))


def test_a_step_of_silent_groups_only_is_a_version_without_an_update(make_model):
    trainer = _Counting(make_model(0), TrainerConfig(drop_zero_advantage_groups=True), pad_id=0)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step(SILENT)
    assert trainer.version == 1 and trainer.rows == 0
    assert (metrics.tokens, metrics.sequences, metrics.dropped_groups, metrics.dropped_sequences) == (0, 5, 2, 5)
    assert metrics.reward_mean == pytest.approx(3 / 5)
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))


def test_drop_zero_advantage_groups_is_a_boolean():
    assert TrainerConfig().drop_zero_advantage_groups is False
    with pytest.raises(ValueError, match="drop_zero_advantage_groups must be true or false, got 1"):
        TrainerConfig(drop_zero_advantage_groups=1)
