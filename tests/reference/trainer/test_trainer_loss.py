"""The trainer's loss and gradients against a naive reference written with explicit loops over tokens.

The hand-made batch has two groups, a masked tool-output stretch inside a generated answer, tokens
whose behaviour logprob puts the ratio inside and outside the clip range (on both sides, with both
signs of advantage, and beyond the dual clip's cap), and off-policy tokens (version 0 while the
trainer trains version 1).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from reference.trainer.batch import Trajectory, collate
from reference.trainer.config import TrainerConfig
from reference.trainer.loss import token_logprobs
from reference.trainer.trainer import Trainer

# (token ids, generated mask, group, reward, log-ratio offsets per generated token, versions)
# The behaviour logprob of a generated token is the current model's logprob minus its offset, so the
# importance ratio is exp(offset): 0 -> 1 (on-policy), 0.4 -> 1.49 (clipped high), -0.9 -> 0.41
# (clipped low), 1.7 -> 5.5 (past the dual clip's cap of 3).
SPECS = [
    ((5, 6, 7, 8, 9, 10, 11), (0, 0, 1, 1, 0, 0, 1), "a", 1.0, (0.0, 0.4, 1.7), (1, 1, 0)),
    ((5, 6, 7, 12, 13, 14), (0, 0, 1, 1, 1, 1), "a", 0.0, (0.0, -0.9, 1.7, 0.01), (1, 1, 0, 1)),
    ((5, 6, 7, 15), (0, 0, 0, 1), "a", 0.5, (0.02,), (1,)),
    ((8, 9, 16, 17, 18), (0, 0, 1, 1, 1), "b", 0.25, (0.4, -0.9, 0.0), (0, 1, 1)),
    ((8, 9, 19, 20, 1, 2), (0, 0, 1, 0, 0, 1), "b", 1.0, (1.7, -0.05), (1, 1)),
]


@torch.no_grad()
def _model_logprob(model, ids, i: int) -> float:
    logits = model(input_ids=torch.tensor([ids])).logits[0, i - 1]
    return torch.log_softmax(logits.float(), -1)[ids[i]].item()


def make_batch(model) -> list[Trajectory]:
    out = []
    for ids, mask, group, reward, offsets, versions in SPECS:
        positions = [i for i, m in enumerate(mask) if m]
        logprobs = [_model_logprob(model, ids, i) - off for i, off in zip(positions, offsets, strict=True)]
        out.append(Trajectory(ids, mask, logprobs, versions, group, reward))
    return out


def on_policy(trajs) -> list[Trajectory]:
    """The same trajectories with every token stamped version 0 (for a trainer that has not stepped)."""
    return [Trajectory(t.token_ids, t.generated_mask, t.logprobs, (0,) * len(t.versions), t.group_id, t.reward)
            for t in trajs]  # fmt: skip


def naive_advantages(trajs, normalize_std: bool, eps: float) -> list[float]:
    advantages = []
    for t in trajs:
        group = [u.reward for u in trajs if u.group_id == t.group_id]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        advantages.append((t.reward - mean) / (std + eps) if normalize_std else t.reward - mean)
    return advantages


def naive_loss(model, ref_model, trajs, config: TrainerConfig, version: int):
    """Loss (a tensor), clipped-token count and off-policy count, one token at a time; a trajectory that is
    not `trained` counts in its group's advantages only."""
    advantages = naive_advantages(trajs, config.normalize_std, config.std_eps)
    total_tokens = sum(sum(t.generated_mask) for t in trajs if t.trained)
    loss, clipped, off_policy = torch.zeros(()), 0, 0
    for t, adv in zip(trajs, advantages, strict=True):
        if not t.trained:
            continue
        logits = model(input_ids=torch.tensor([t.token_ids])).logits[0].float()
        ref_logits = ref_model(input_ids=torch.tensor([t.token_ids])).logits[0].float() if ref_model else None
        k = 0
        for i in range(1, len(t.token_ids)):
            if not t.generated_mask[i]:
                continue
            logsm = torch.log_softmax(logits[i - 1], -1)
            logp = logsm[t.token_ids[i]]
            ratio = torch.exp(logp - t.logprobs[k])
            low, high = 1 - config.clip_eps, 1 + config.clip_eps_high
            surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
            if adv < 0:
                surrogate = torch.maximum(surrogate, torch.tensor(config.ratio_cap * adv))
            term = -surrogate
            entropy = -(logsm.exp() * logsm).sum()
            term = term - config.entropy_coef * entropy
            if ref_logits is not None:
                d = torch.log_softmax(ref_logits[i - 1], -1)[t.token_ids[i]].detach() - logp
                term = term + config.kl_coef * (torch.exp(d) - d - 1)
            outside = not low <= ratio.item() <= high
            clipped += int(outside and (ratio.item() - 1) * adv > 0)  # the clip removed this token's gradient
            off_policy += int(t.versions[k] < version)
            loss = loss + term / total_tokens
            k += 1
    return loss, clipped, off_policy


def _trainer_after_one_step(make_model, config: TrainerConfig, ref_model=None) -> Trainer:
    """A trainer at version 1 (so version-0 tokens are off-policy), after one step on a warm-up batch."""
    trainer = Trainer(make_model(0), config, pad_id=0, ref_model=ref_model)
    warmup = [Trajectory((3, 4, 5), (0, 1, 1), (-3.0, -3.0), (0, 0), "w", float(r)) for r in range(2)]
    trainer.train_step(warmup)
    assert trainer.version == 1
    return trainer


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("clip_eps_high", [None, 0.6])
def test_loss_and_gradients_match_the_naive_reference(make_model, normalize_std, kl_coef, clip_eps_high):
    config = TrainerConfig(normalize_std=normalize_std, kl_coef=kl_coef, grad_clip=0.0, micro_batch_size=2,
                           clip_eps_high=clip_eps_high)  # fmt: skip
    ref_model = make_model(7) if kl_coef else None
    trainer = _trainer_after_one_step(make_model, config, ref_model)
    before = copy.deepcopy(trainer.model)
    trajs = make_batch(before)

    expected, clipped, off_policy = naive_loss(before, ref_model, trajs, config, trainer.version)
    expected.backward()
    metrics = trainer.train_step(trajs)  # grad_clip 0: p.grad is left as the raw gradient

    assert metrics.loss == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert metrics.tokens == 13
    assert metrics.clip_fraction == pytest.approx(clipped / 13)
    assert metrics.off_policy_fraction == pytest.approx(off_policy / 13)
    assert metrics.dual_clip_fraction > 0
    for (name, p), q in zip(trainer.model.named_parameters(), before.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_masked_sample_counts_in_its_groups_advantages_but_not_in_the_loss(make_model):
    """Overlong filtering: the second trajectory (reward 0 in group a) is masked; group a's baseline still holds
    its reward, and the loss is the token mean over the other trajectories' tokens alone."""
    config = TrainerConfig(grad_clip=0.0, micro_batch_size=2)
    trainer = _trainer_after_one_step(make_model, config)
    before = copy.deepcopy(trainer.model)
    trajs = [dataclasses.replace(t, trained=i != 1) for i, t in enumerate(make_batch(before))]
    expected, _, _ = naive_loss(before, None, trajs, config, trainer.version)
    expected.backward()
    metrics = trainer.train_step(trajs)
    assert metrics.tokens == 9 and metrics.sequences == 5  # 13 generated tokens, 4 of them masked
    assert metrics.loss == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    for (name, p), q in zip(trainer.model.named_parameters(), before.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_step_whose_samples_are_all_masked_is_a_version_without_an_update(make_model):
    trainer = Trainer(make_model(0), TrainerConfig(), pad_id=0)
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    trajs = [Trajectory((3, 4, 5), (0, 1, 1), (-3.0, -3.0), (0, 0), "g", float(r), trained=False) for r in range(2)]
    metrics = trainer.train_step(trajs)
    assert trainer.version == 1 and metrics.tokens == 0 and metrics.sequences == 2
    assert all(torch.equal(p, w) for p, w in zip(trainer.model.parameters(), weights, strict=True))


def test_every_interesting_case_occurs_in_the_batch(make_model):
    """The hand-made batch really has clipped, dual-clipped, off-policy, masked and on-policy tokens."""
    trainer = _trainer_after_one_step(make_model, TrainerConfig())
    metrics = trainer.train_step(make_batch(copy.deepcopy(trainer.model)))
    assert 0 < metrics.clip_fraction < 1
    assert metrics.dual_clip_fraction > 0
    assert metrics.off_policy_fraction == pytest.approx(3 / 13)
    assert metrics.ratio_max == pytest.approx(math.exp(1.7), rel=1e-4)
    assert metrics.ratio_min == pytest.approx(math.exp(-0.9), rel=1e-4)
    assert metrics.staleness_max == 1


def test_micro_batching_does_not_change_the_gradient(make_model):
    grads = []
    for size in (1, 2, 64):
        trainer = Trainer(make_model(0), TrainerConfig(micro_batch_size=size, grad_clip=0.0), pad_id=0)
        trainer.train_step(on_policy(make_batch(trainer.model)))
        grads.append(torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[2], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[2], rtol=1e-4, atol=1e-6)


def test_an_all_equal_group_contributes_only_its_entropy_bonus(make_model):
    """Equal rewards give zero advantage: with no entropy bonus the gradient is exactly zero."""
    trainer = Trainer(make_model(0), TrainerConfig(entropy_coef=0.0, grad_clip=0.0), pad_id=0)
    trajs = [Trajectory((3, 4, 5), (0, 1, 1), (-3.0, -3.0), (0, 0), "g", 0.5) for _ in range(3)]
    metrics = trainer.train_step(trajs)
    assert metrics.grad_norm == 0.0


def test_a_token_from_a_future_version_is_refused(make_model):
    trainer = Trainer(make_model(0), TrainerConfig(), pad_id=0)
    with pytest.raises(ValueError, match="version 1, newer than the trainer's 0"):
        trainer.train_step([Trajectory((3, 4), (0, 1), (-1.0,), (1,), "g", 1.0)])


def test_kl_needs_a_reference_model(make_model):
    with pytest.raises(ValueError, match="kl_coef 0.1 > 0 needs a frozen reference model"):
        Trainer(make_model(0), TrainerConfig(kl_coef=0.1), pad_id=0)


def test_gradient_clipping_bounds_the_update_norm(make_model):
    trainer = Trainer(make_model(0), TrainerConfig(grad_clip=1e-3), pad_id=0)
    metrics = trainer.train_step(on_policy(make_batch(trainer.model)))
    norm = torch.sqrt(sum((p.grad**2).sum() for p in trainer.model.parameters()))
    assert metrics.grad_norm > 1e-3
    assert norm.item() == pytest.approx(1e-3, rel=1e-3)


def test_micro_batches_hold_sequences_of_similar_length(make_model, monkeypatch):
    """Each micro-batch is padded to its longest sequence: the trainer cuts them from the batch sorted by
    length, so the long and the short sequences do not share one."""
    import reference.trainer.trainer as trainer_module

    widths = []
    real_collate = trainer_module.collate

    def recording(trajectories, *args, **kwargs):
        widths.append(sorted(len(t.token_ids) for t in trajectories))
        return real_collate(trajectories, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "collate", recording)
    trainer = Trainer(make_model(0), TrainerConfig(micro_batch_size=2), pad_id=0)
    lengths = (20, 3, 20, 3)  # alternating: an unsorted cut would pair a 20 with a 3 twice
    batch = [Trajectory(tuple(range(1, n + 1)), (0,) + (1,) * (n - 1), (-1.0,) * (n - 1), (0,) * (n - 1),
                        "g", float(i)) for i, n in enumerate(lengths)]  # fmt: skip
    trainer.train_step(batch)
    assert widths == [[3, 3], [20, 20]]


def test_the_learning_rate_warms_up_linearly(make_model):
    """Adam's first steps move every weight by about the learning rate whatever the gradient's size; with
    `warmup_steps` the k-th step (from 0) uses lr * (k + 1) / warmup_steps, then lr."""
    # normalize_std True (the default before 2026-11-29): with it this batch's gradients keep every Adam step within lr
    config = TrainerConfig(lr=1e-2, warmup_steps=4, weight_decay=0.0, entropy_coef=0.0, normalize_std=True)
    trainer = Trainer(make_model(0), config, pad_id=0)
    moves = []
    for _ in range(5):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train_step(on_policy(make_batch(trainer.model)))
        after = trainer.model.parameters()
        moves.append(max((p.detach() - q).abs().max().item() for p, q in zip(after, before, strict=True)))
    assert moves[0] == pytest.approx(2.5e-3, rel=1e-3)  # Adam's first step: |m / sqrt(v)| = 1 for every weight
    assert all(m <= lr * 1.01 for m, lr in zip(moves, [2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2], strict=True))
    assert moves[3] > moves[0] * 1.5
    assert trainer.learning_rate == 1e-2


def test_a_trainer_adopts_another_optimisers_moments_but_keeps_its_own_settings(make_model):
    """The warm start's AdamW state carried into RL: the moments and step count come over, the learning rate,
    betas and weight decay stay the trainer's; a state over other parameters is refused."""
    model = make_model(0)
    donor_model = make_model(0)
    donor = torch.optim.AdamW(donor_model.parameters(), lr=3e-3, weight_decay=0.0)
    batch = on_policy(make_batch(donor_model))
    donor_trainer = Trainer(donor_model, TrainerConfig(), pad_id=0)
    donor_trainer.optimizer = donor
    donor_trainer.train_step(batch)
    trainer = Trainer(model, TrainerConfig(lr=1e-4, weight_decay=0.05), pad_id=0)
    trainer.adopt_optimizer_moments(donor.state_dict())
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [1e-4]
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.05]
    for p, q in zip(model.parameters(), donor_model.parameters(), strict=True):
        torch.testing.assert_close(trainer.optimizer.state[p]["exp_avg_sq"], donor.state[q]["exp_avg_sq"])
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError):
        trainer.adopt_optimizer_moments(other.state_dict())


class _AlwaysBackward(Trainer):
    def _without_gradient(self, batch) -> bool:
        return False


class _Counting(Trainer):
    skipped = 0

    def _without_gradient(self, batch) -> bool:
        skip = super()._without_gradient(batch)
        self.skipped += skip
        return skip


def test_episodes_without_a_gradient_skip_the_backward_pass_but_not_the_metrics(make_model):
    """Under negative_weight 0 the below-mean samples (and whole equal groups) have advantage 0: the trainer
    runs no backward pass for them, and the step is the same as with one (gradient and every metric)."""
    config = TrainerConfig(negative_weight=0.0, entropy_coef=0.0, kl_coef=0.0, grad_clip=0.0, micro_batch_size=1)
    fast, full = _Counting(make_model(0), config, pad_id=0), _AlwaysBackward(make_model(0), config, pad_id=0)
    trajs = on_policy(make_batch(fast.model))
    trajs += [dataclasses.replace(trajs[i], group_id="equal", reward=1.0) for i in (0, 1)]
    a, b = fast.train_step(trajs), full.train_step(trajs)
    assert fast.skipped == 5  # the two below-mean samples of group a, one of b, both of the equal group
    for field in ("loss", "entropy", "ratio_mean", "clip_fraction", "tokens", "sequences", "reward_mean", "grad_norm"):
        assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-5, abs=1e-7), field
    for p, q in zip(fast.model.parameters(), full.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


class _MicroSteps(Trainer):
    calls = 0

    def _micro_step(self, batch, total_tokens):
        self.calls += len(batch.advantages)
        return super()._micro_step(batch, total_tokens)


def test_epochs_are_optimiser_steps_on_the_same_data_the_later_ones_only_where_a_gradient_is(make_model):
    """`epochs` 2 is one version of the weights made by two optimiser steps on the step's data: the same weights
    as two steps of one epoch on it (the later epoch normalised by the same token count, clipped against the same
    behaviour log-probs), the first epoch's metrics, and a second epoch that leaves out the samples of advantage 0."""
    config = TrainerConfig(negative_weight=0.0, entropy_coef=0.0, kl_coef=0.0, micro_batch_size=1, lr=1e-2)
    twice = _MicroSteps(make_model(0), dataclasses.replace(config, epochs=2), pad_id=0)
    single = Trainer(make_model(0), config, pad_id=0)
    trajs = on_policy(make_batch(twice.model))
    trajs += [dataclasses.replace(trajs[i], group_id="equal", reward=1.0) for i in (0, 1)]
    m = twice.train_step(trajs)
    first = single.train_step(trajs)
    single.train_step(trajs)
    assert twice.calls == len(trajs) + (len(trajs) - 5)  # 5 samples have advantage 0 (see the test above)
    assert twice.version == 1 and single.version == 2
    for field in ("loss", "entropy", "ratio_mean", "clip_fraction", "tokens", "reward_mean", "grad_norm"):
        assert getattr(m, field) == pytest.approx(getattr(first, field), rel=1e-6), field
    moved = False
    for p, q, r in zip(twice.model.parameters(), single.model.parameters(), make_model(0).parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        moved |= not torch.equal(p, r)
    assert moved


def test_a_later_epoch_with_nothing_to_train_leaves_the_weights_alone(make_model):
    config = TrainerConfig(negative_weight=0.0, entropy_coef=0.0, kl_coef=0.0, micro_batch_size=1, epochs=3)
    trainer = _MicroSteps(make_model(0), config, pad_id=0)
    trajs = [dataclasses.replace(t, group_id="equal", reward=1.0) for t in on_policy(make_batch(trainer.model))]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step(trajs)  # every advantage 0: the later epochs get no sample
    assert trainer.calls == len(trajs) and trainer.version == 1 and metrics.sequences == len(trajs)
    for p, q in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(p, q)


def test_epochs_must_be_a_whole_number_of_at_least_one():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"TrainerConfig.epochs must be an integer >= 1, got"):
            TrainerConfig(epochs=bad)


def test_an_entropy_bonus_keeps_the_backward_pass(make_model):
    config = TrainerConfig(negative_weight=0.0, entropy_coef=0.01, grad_clip=0.0, micro_batch_size=1)
    trainer = _Counting(make_model(0), config, pad_id=0)
    trainer.train_step(on_policy(make_batch(trainer.model)))
    assert trainer.skipped == 0


def test_token_logprobs_project_the_vocabulary_only_at_trained_tokens(make_model):
    model = make_model(0)
    trajs = make_batch(model)
    trajs[1] = dataclasses.replace(trajs[1], trained=False)
    batch = collate(trajs, [0.0] * len(trajs), 0)
    logp, entropy = token_logprobs(model, batch)
    with torch.no_grad():
        logsm = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, -1)
    full_logp = logsm[:, :-1].gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    full_entropy = -(logsm.exp() * logsm).sum(-1)[:, :-1]
    on = batch.mask > 0
    torch.testing.assert_close(logp[on], full_logp[on], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy[on], full_entropy[on], rtol=1e-5, atol=1e-6)
    # only the trained tokens are projected; the rest (prompts, tool outputs, the untrained row) are 0
    assert bool((logp[~on] == 0).all()) and bool((entropy[~on] == 0).all())
    assert not bool(on[1].any()) and int(on.any(0).sum()) < on.shape[1]
