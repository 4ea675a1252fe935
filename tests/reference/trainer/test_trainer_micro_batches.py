"""Micro-batches by a padded-token budget (`micro_batch_tokens`): every trajectory in exactly one micro-batch,
none over the budget but a lone over-long sequence, and the same step as one micro-batch of everything."""

from __future__ import annotations

import logging
import random

import pytest
import torch

import reference.trainer.trainer as trainer_module
from reference.trainer.batch import Trajectory
from reference.trainer.config import TrainerConfig
from reference.trainer.trainer import Trainer, token_budget_slices


def trajectories(seed: int = 0) -> list[Trajectory]:
    """Three groups of long-tailed lengths (3 to 40 tokens), generated answers after 1-4 prompt tokens, tokens of
    the current version 0, one sample masked out of the loss."""
    rng = random.Random(seed)
    out = []
    for group in range(3):
        for k in range(5):
            prompt, answer = rng.randint(1, 4), rng.choice([2, 3, 5, 8, 13, 36])
            ids = [rng.randrange(3, 22) for _ in range(prompt + answer)]
            logprobs = [-rng.uniform(2, 4) for _ in range(answer)]
            out.append(Trajectory(ids, [0] * prompt + [1] * answer, logprobs, [0] * answer, group, rng.random(),
                                  trained=(group, k) != (1, 2)))  # fmt: skip
    return out


def test_token_budget_slices_cover_every_row_once_within_the_budget():
    rng = random.Random(3)
    for _ in range(200):
        lengths = sorted(rng.randint(1, 50) for _ in range(rng.randint(1, 30)))
        budget = rng.randint(1, 120)
        bounds = token_budget_slices(lengths, budget)
        assert [i for lo, hi in bounds for i in range(lo, hi)] == list(range(len(lengths)))
        for lo, hi in bounds:
            assert hi > lo
            assert (hi - lo) * max(lengths[lo:hi]) <= budget or hi - lo == 1  # a lone row may be over
        for lo, hi in bounds[:-1]:  # greedy: the next row did not fit
            assert (hi - lo + 1) * max(lengths[lo : hi + 1]) > budget
    assert token_budget_slices([2, 50, 3], 10) == [(0, 1), (1, 2), (2, 3)]  # unsorted: the longest row counts
    assert token_budget_slices([], 10) == []


def _recording(monkeypatch) -> list:
    calls = []
    real = trainer_module.collate

    def collate(trajs, advantages, pad_id, *args, **kwargs):
        batch = real(trajs, advantages, pad_id, *args, **kwargs)
        calls.append((list(trajs), tuple(batch.input_ids.shape), batch))
        return batch

    monkeypatch.setattr(trainer_module, "collate", collate)
    return calls


@pytest.mark.parametrize("budget", [1, 30, 64, 100, 10_000])
def test_every_token_is_in_exactly_one_micro_batch_within_the_budget(make_model, monkeypatch, budget):
    calls = _recording(monkeypatch)
    trajs = trajectories()
    trainer = Trainer(make_model(0), TrainerConfig(micro_batch_tokens=budget), pad_id=0)
    trainer.train_step(trajs)
    seen = [t for batch_trajs, _, _ in calls for t in batch_trajs]
    assert sorted(map(id, seen)) == sorted(map(id, trajs))  # every trajectory once, so every token once
    assert sum(int(batch.mask.sum()) for _, _, batch in calls) == sum(t.num_generated for t in trajs if t.trained)
    for batch_trajs, (rows, width), _ in calls:
        assert width == max(len(t.token_ids) for t in batch_trajs)
        assert rows * width <= budget or rows == 1
    if budget == 1:
        assert len(calls) == len(trajs)
    if budget == 10_000:
        assert len(calls) == 1


def test_a_sequence_over_the_budget_trains_alone_with_a_warning(make_model, monkeypatch, caplog):
    calls = _recording(monkeypatch)
    trainer = Trainer(make_model(0), TrainerConfig(micro_batch_tokens=30), pad_id=0)
    with caplog.at_level(logging.WARNING, logger="reference.trainer.trainer"):
        trainer.train_step(trajectories())
    longest = max(len(t.token_ids) for t in trajectories())
    assert any(shape == (1, longest) for _, shape, _ in calls)
    assert "longer than micro_batch_tokens 30" in caplog.text and f"the longest {longest} tokens" in caplog.text


def test_the_step_does_not_depend_on_the_split(make_model):
    """The loss is the step's global token mean: a budget of any size gives one micro-batch's update and metrics."""
    results = []
    for config in (TrainerConfig(micro_batch_size=64), TrainerConfig(micro_batch_tokens=1),
                   TrainerConfig(micro_batch_tokens=40), TrainerConfig(micro_batch_tokens=90)):  # fmt: skip
        trainer = Trainer(make_model(0), config, pad_id=0)
        metrics = trainer.train_step(trajectories())
        results.append((metrics, [p.detach().clone() for p in trainer.model.parameters()]))
    (want, want_params), rest = results[0], results[1:]
    for metrics, params in rest:
        for field in ("loss", "pg_loss", "entropy", "clip_fraction", "grad_norm", "ratio_mean", "reward_mean"):
            assert getattr(metrics, field) == pytest.approx(getattr(want, field), rel=1e-5, abs=1e-7), field
        assert (metrics.tokens, metrics.sequences) == (want.tokens, want.sequences)
        for p, q in zip(params, want_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_micro_batch_tokens_is_off_at_zero_or_null_and_never_negative():
    assert TrainerConfig().micro_batch_tokens == 0
    assert TrainerConfig(micro_batch_tokens=None).micro_batch_tokens == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="TrainerConfig.micro_batch_tokens must be an integer >= 0"):
            TrainerConfig(micro_batch_tokens=bad)
