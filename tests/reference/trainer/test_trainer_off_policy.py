"""The off-policy corrections ("tis", "decoupled") against naive per-token loops written here: the loss of each
token, its gradient, the step's gradient through a whole model, the proximal log-probs the later epochs reuse and
the engine-trainer mismatch metrics. "behaviour" is the loss of `test_trainer_loss.py`, whose tests it passes."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from reference.trainer.batch import TokenBatch, Trajectory
from reference.trainer.config import TrainerConfig
from reference.trainer.loss import grpo_loss
from reference.trainer.trainer import Trainer

CLIP, CLIP_HIGH, CAP, TIS_CAP, KL_COEF, ENTROPY_COEF = 0.2, 0.28, 3.0, 2.0, 0.1, 0.01


def naive_token(logp, entropy, ref, behaviour, proximal, adv: float, mode: str):
    """One token's term of the loss, written out."""
    old = behaviour if mode == "behaviour" else proximal
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - CLIP, 1 + CLIP_HIGH) * adv)
    if adv < 0:
        surrogate = torch.maximum(surrogate, torch.tensor(CAP * adv))
    rho = math.exp(proximal - behaviour)
    weight = {"behaviour": 1.0, "tis": min(rho, TIS_CAP), "decoupled": rho if rho <= TIS_CAP else 0.0}[mode]
    d = ref - logp
    return weight * -surrogate + KL_COEF * (torch.exp(d) - d - 1) - ENTROPY_COEF * entropy, weight, rho > TIS_CAP


def small_batch():
    """Three rows of five targets: a masked one in each of two rows, both signs of advantage; the ratio to the
    proximal log-prob inside and outside the clip range (and past the dual clip's cap), the behaviour weight
    pi_prox / pi_behaviour below 1, near 1 and past the cap of 2."""
    proximal = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5], [-0.7, -1.1, -2.2, -0.4, -1.9],
                             [-2.5, -0.3, -1.2, -0.8, -1.0]])  # fmt: skip
    theta_minus_prox = torch.tensor([[0.0, 0.4, -0.9, 1.7, 0.1], [0.05, 1.7, -0.9, 0.3, 0.0],
                                     [-0.3, 0.2, 1.2, 0.0, -0.05]])  # fmt: skip
    prox_minus_behaviour = torch.tensor([[0.0, 0.5, 1.0, -0.7, 2.0], [0.3, -0.2, 0.9, 0.01, -1.5],
                                         [0.69, 0.7, -0.4, 1.3, 0.0]])  # fmt: skip
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.float32)
    batch = TokenBatch(
        input_ids=torch.zeros(3, 6, dtype=torch.long), attention_mask=None, mask=mask,
        behaviour_logprobs=proximal - prox_minus_behaviour, versions=torch.zeros(3, 5, dtype=torch.long),
        advantages=torch.tensor([1.0, -0.8, 0.5]), proximal_logprobs=proximal,
    )  # fmt: skip
    logp = (proximal + theta_minus_prox).requires_grad_()
    entropy = torch.tensor([[1.0, 2.0, 0.5, 0.1, 3.0], [0.7, 0.2, 1.1, 2.2, 0.9], [1.3, 0.4, 0.6, 0.8, 1.9]])
    ref = proximal + 0.3 * torch.tensor([[1.0, -1.0, 0.5, 0.2, 0.0], [-0.4, 0.1, 0.9, -0.6, 0.3], [0.2] * 5])
    return batch, logp, entropy.requires_grad_(), ref


@pytest.mark.parametrize("mode", ["behaviour", "tis", "decoupled"])
def test_each_tokens_loss_and_gradient_match_a_naive_loop(mode):
    batch, logp, entropy, ref = small_batch()
    total = 17  # the step's token count: more than this micro-batch's 13
    coefs = dict(entropy_coef=ENTROPY_COEF, kl_coef=KL_COEF, ref_logp=ref, off_policy=mode, tis_cap=TIS_CAP)
    out = grpo_loss(logp, entropy, batch, total, clip_eps=CLIP, clip_eps_high=CLIP_HIGH, ratio_cap=CAP, **coefs)
    got_logp, got_entropy = torch.autograd.grad(out.loss, (logp, entropy))

    naive_logp, naive_entropy = logp.detach().clone().requires_grad_(), entropy.detach().clone().requires_grad_()
    loss, capped = torch.zeros(()), 0
    for b in range(3):
        for t in range(5):
            if not batch.mask[b, t]:
                continue
            term, weight, over = naive_token(
                naive_logp[b, t], naive_entropy[b, t], ref[b, t].item(), batch.behaviour_logprobs[b, t].item(),
                batch.proximal_logprobs[b, t].item(), batch.advantages[b].item(), mode,
            )  # fmt: skip
            assert out.per_token[b, t].item() == pytest.approx(term.item(), rel=1e-5, abs=1e-6), (b, t)
            assert out.weight[b, t].item() == pytest.approx(weight, rel=1e-5), (b, t)
            capped += over and mode != "behaviour"
            loss = loss + term / total
    want_logp, want_entropy = torch.autograd.grad(loss, (naive_logp, naive_entropy))
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(got_logp, want_logp, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_entropy, want_entropy, rtol=1e-5, atol=1e-7)
    assert int(out.capped.sum()) == capped and (capped > 0) == (mode != "behaviour")
    assert bool(out.clipped.any()) and bool(out.dual_clipped.any())
    on = batch.mask > 0
    torch.testing.assert_close(out.mismatch[on], (batch.proximal_logprobs - batch.behaviour_logprobs)[on])
    if mode == "behaviour":  # no proximal pass: the trainer's log-prob is logp_theta's (the same weights, epoch 1)
        plain = dataclasses.replace(batch, proximal_logprobs=None)
        out = grpo_loss(logp, entropy, plain, total, clip_eps=CLIP, ratio_cap=CAP)
        torch.testing.assert_close(out.mismatch[on], (logp.detach() - batch.behaviour_logprobs)[on])


def test_the_corrections_need_the_proximal_logprobs():
    batch, logp, entropy, _ = small_batch()
    batch = dataclasses.replace(batch, proximal_logprobs=None)
    with pytest.raises(ValueError, match="off_policy 'tis' needs the proximal log-probs"):
        grpo_loss(logp, entropy, batch, 13, clip_eps=0.2, ratio_cap=3.0, off_policy="tis")
    with pytest.raises(ValueError, match="unknown off_policy 'ppo'"):
        grpo_loss(logp, entropy, batch, 13, clip_eps=0.2, ratio_cap=3.0, off_policy="ppo")


# (token ids, generated mask, group, reward, pi_prox / pi_behaviour as a log, versions): the trainer is at version
# 1, so version-1 tokens are fresh and version-0 ones a step stale; exp(1.7) and exp(0.9) are past the cap of 2.
SPECS = [
    ((5, 6, 7, 8, 9, 10, 11), (0, 0, 1, 1, 0, 0, 1), "a", 1.0, (0.0, 0.4, 1.7), (1, 1, 0)),
    ((5, 6, 7, 12, 13, 14), (0, 0, 1, 1, 1, 1), "a", 0.0, (0.0, -0.9, 0.9, 0.01), (1, 1, 0, 1)),
    ((5, 6, 7, 15), (0, 0, 0, 1), "a", 0.5, (0.02,), (1,)),
    ((8, 9, 16, 17, 18), (0, 0, 1, 1, 1), "b", 0.25, (0.4, -0.9, 0.0), (0, 1, 1)),
    ((8, 9, 19, 20, 1, 2), (0, 0, 1, 0, 0, 1), "b", 1.0, (1.7, -0.05), (1, 1)),
]


def batch_for(model) -> list[Trajectory]:
    out = []
    for ids, mask, group, reward, offsets, versions in SPECS:
        with torch.no_grad():
            logsm = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        positions = [i for i, m in enumerate(mask) if m]
        logprobs = [logsm[i - 1, ids[i]].item() - off for i, off in zip(positions, offsets, strict=True)]
        out.append(Trajectory(ids, mask, logprobs, versions, group, reward))
    return out


def naive_step_loss(model, trajs, config: TrainerConfig):
    """The step's loss through the model, one token at a time (no reference model: the KL term is 0)."""
    rewards = {g: [t.reward for t in trajs if t.group_id == g] for g in {t.group_id for t in trajs}}
    total = sum(t.num_generated for t in trajs)
    loss = torch.zeros(())
    for t in trajs:
        mean = sum(rewards[t.group_id]) / len(rewards[t.group_id])
        adv = t.reward - mean  # normalize_std False
        logsm = torch.log_softmax(model(input_ids=torch.tensor([t.token_ids])).logits[0].float(), -1)
        k = 0
        for i in range(1, len(t.token_ids)):
            if not t.generated_mask[i]:
                continue
            logp = logsm[i - 1, t.token_ids[i]]
            entropy = -(logsm[i - 1].exp() * logsm[i - 1]).sum()
            old = logp.item()  # the proximal log-prob: the same weights, before the update
            ratio = torch.exp(logp - old)
            surrogate = torch.minimum(
                ratio * adv, torch.clamp(ratio, 1 - config.clip_eps, 1 + config.clip_eps_high) * adv
            )
            if adv < 0:
                surrogate = torch.maximum(surrogate, torch.tensor(config.ratio_cap * adv))
            rho = math.exp(old - t.logprobs[k])
            weight = min(rho, config.tis_cap) if config.off_policy == "tis" else (rho if rho <= config.tis_cap else 0.0)
            loss = loss + (weight * -surrogate - config.entropy_coef * entropy) / total
            k += 1
    return loss


def trainer_at_version_one(make_model, config: TrainerConfig, cls=Trainer) -> Trainer:
    trainer = cls(make_model(0), config, pad_id=0)
    warmup = [Trajectory((3, 4, 5), (0, 1, 1), (-3.0, -3.0), (0, 0), "w", float(r)) for r in range(2)]
    trainer.train_step(warmup)
    return trainer


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_a_steps_gradient_matches_the_naive_loop_through_the_model(make_model, mode):
    config = TrainerConfig(off_policy=mode, grad_clip=0.0, micro_batch_size=2, normalize_std=False)
    trainer = trainer_at_version_one(make_model, config)
    before = copy.deepcopy(trainer.model)
    trajs = batch_for(before)
    expected = naive_step_loss(before, trajs, config)
    expected.backward()
    metrics = trainer.train_step(trajs)
    assert metrics.loss == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    for (name, p), q in zip(trainer.model.named_parameters(), before.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)

    offsets = [o for spec in SPECS for o in spec[4]]
    fresh = [o for spec in SPECS for o, v in zip(spec[4], spec[5], strict=True) if v == 1]
    weights = [min(math.exp(o), 2.0) if mode == "tis" else (math.exp(o) if math.exp(o) <= 2 else 0) for o in offsets]
    assert metrics.tokens == len(offsets) == 13 and metrics.fresh_tokens == len(fresh) == 10
    assert metrics.is_weight_mean == pytest.approx(sum(weights) / 13, rel=1e-4)
    assert metrics.is_weight_max == pytest.approx(max(weights), rel=1e-4)
    assert metrics.is_capped_fraction == pytest.approx(sum(math.exp(o) > 2 for o in offsets) / 13)
    assert metrics.fresh_mismatch_mean == pytest.approx(sum(fresh) / len(fresh), abs=1e-5)
    assert metrics.fresh_kl == pytest.approx(sum(math.exp(o) - 1 - o for o in fresh) / len(fresh), abs=1e-5)
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-6)  # the ratio to the proximal policy before the update


def test_behaviour_reports_the_mismatch_and_a_weight_of_one(make_model):
    trainer = trainer_at_version_one(make_model, TrainerConfig())
    metrics = trainer.train_step(batch_for(copy.deepcopy(trainer.model)))
    fresh = [o for spec in SPECS for o, v in zip(spec[4], spec[5], strict=True) if v == 1]
    assert metrics.is_weight_mean == 1.0 and metrics.is_weight_max == 1.0 and metrics.is_capped_fraction == 0.0
    assert metrics.fresh_tokens == 10
    assert metrics.fresh_mismatch_mean == pytest.approx(sum(fresh) / len(fresh), abs=1e-5)
    assert metrics.fresh_kl == pytest.approx(sum(math.exp(o) - 1 - o for o in fresh) / len(fresh), abs=1e-5)


class _Recording(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def _micro_step(self, batch, total_tokens):
        self.seen.append(batch.proximal_logprobs.clone())
        return super()._micro_step(batch, total_tokens)


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_later_epochs_reuse_the_proximal_logprobs_of_the_first(make_model, mode):
    config = TrainerConfig(off_policy=mode, epochs=3, lr=1e-2, micro_batch_size=64)
    trainer = trainer_at_version_one(make_model, config, _Recording)
    before = copy.deepcopy(trainer.model)
    trajs = batch_for(before)
    trainer.seen.clear()
    trainer.train_step(trajs)
    assert len(trainer.seen) == 3
    assert all(torch.equal(seen, trainer.seen[0]) for seen in trainer.seen)
    want = {}  # the log-prob of each generated token under the weights before the step
    for t in trajs:
        with torch.no_grad():
            logsm = torch.log_softmax(before(input_ids=torch.tensor([t.token_ids])).logits[0].float(), -1)
        want[t.token_ids] = [logsm[i - 1, t.token_ids[i]].item() for i, m in enumerate(t.generated_mask) if m]
    order = sorted(trajs, key=lambda t: len(t.token_ids))
    for row, t in enumerate(order):
        got = trainer.seen[0][row][[i - 1 for i, m in enumerate(t.generated_mask) if m]]
        torch.testing.assert_close(got, torch.tensor(want[t.token_ids]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("off_policy", "ppo", "off_policy must be one of \\['behaviour', 'tis', 'decoupled'\\], got 'ppo'"),
     ("tis_cap", 0.5, "tis_cap must be >= 1, got 0.5"), ("tis_cap", math.inf, "tis_cap must be a finite number")],
)  # fmt: skip
def test_the_off_policy_fields_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**{field: value})
