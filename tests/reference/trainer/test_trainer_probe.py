"""The in-process probe: its sampler's logprobs are the trainer's, and GRPO learns the math task."""

from __future__ import annotations

import pytest
import torch

from reference.model import score_logprobs
from reference.tasks import make_task
from reference.trainer.config import TrainerConfig
from reference.trainer.probe import rollout, run_probe, sample_tokens
from reference.trainer.recipe import MathRecipe
from reference.trainer.trainer import Trainer

TINY = MathRecipe(hidden_size=32, num_layers=1, head_dim=16, intermediate_size=64, prompts_per_step=4, group_size=4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_what_a_plain_forward_scores(make_model, temperature):
    model = make_model(0)
    prompts = torch.tensor([[6, 7, 8, 20, 7, 18], [9, 9, 9, 20, 8, 18]])
    tokens, logprobs = sample_tokens(model, prompts, 3, torch.Generator().manual_seed(0), temperature)
    for row in range(2):
        scored = score_logprobs(model, prompts[row].tolist() + tokens[row].tolist(), temperature)[-3:]
        assert logprobs[row].tolist() == pytest.approx(scored, abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_on_policy_rollouts_give_unit_ratios_and_no_clipping(make_model, temperature):
    """The probe samples at the trainer's temperature, whose log-probs the trainer then computes."""
    task = make_task("math")
    config = TrainerConfig(temperature=temperature)
    trainer = Trainer(make_model(0), config, pad_id=task.tokenizer.pad_token_id)
    trajs = rollout(trainer, task, task.sample_train(trainer.rng, 4), group_size=4)
    assert len(trajs) == 16
    assert all(t.num_generated == task.max_tokens for t in trajs)
    assert all(t.versions == (0, 0, 0) for t in trajs)
    metrics = trainer.train_step(trajs)
    assert metrics.ratio_max == pytest.approx(1.0, abs=1e-4)
    assert metrics.ratio_min == pytest.approx(1.0, abs=1e-4)
    assert metrics.clip_fraction == 0.0


def test_the_probe_reports_random_policy_and_per_step_rewards():
    lines: list[str] = []
    result = run_probe(TINY, seed=0, max_steps=4, eval_every_steps=2, log=lines.append)
    assert lines[0].startswith("seed 0: random-policy reward")
    assert "held-out" in lines[2]
    assert result.steps == 4
    assert 0 <= result.random_policy_reward <= 1
    assert result.chance_reward == pytest.approx(1 / 22)
    assert result.seconds_to_target is None


def test_a_lagged_probe_trains_on_tokens_from_the_weights_of_steps_before(monkeypatch):
    """`lag=2`: step k's batch is sampled by the weights of step max(0, k - 2), and its tokens say so."""
    import reference.trainer.probe as probe

    seen: list[tuple[int, int, bool]] = []  # (trainer version, tokens' version, sampled by the live model)
    real = probe.rollout

    def spy(trainer, task, problems, group_size, behaviour=None, version=None):
        trajs = real(trainer, task, problems, group_size, behaviour, version)
        seen.append((trainer.version, trajs[0].versions[-1], behaviour is None or behaviour is trainer.model))
        same = all(torch.equal(a, b) for a, b in zip(behaviour.parameters(), trainer.model.parameters(), strict=True))
        assert same == (version == trainer.version)  # the snapshot is the live weights only when not stale
        return trajs

    monkeypatch.setattr(probe, "rollout", spy)
    result = run_probe(TINY, seed=0, max_steps=5, eval_every_steps=100, lag=2, log=lambda _: None)
    assert result.steps == 5
    assert [(v, old) for v, old, _ in seen] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2)]
    assert not any(live for *_, live in seen)


@pytest.mark.slow
def test_grpo_learns_the_math_task_from_a_random_start():
    """Seed 0, default recipe, 150 steps (about 20 s on 2 idle cores): the training reward leaves the random
    policy's level far behind, and so does the held-out reward."""
    result = run_probe(MathRecipe(), seed=0, max_steps=150, max_seconds=600, eval_every_steps=1000, log=lambda _: None)
    assert result.random_policy_reward < 0.1
    assert result.train_reward > 0.35
    assert result.held_out_reward > 0.3
