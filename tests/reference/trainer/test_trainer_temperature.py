"""The trainer's temperature: every log-prob it takes (the policy's, the proximal ones, the KL reference's, the
entropy) is of softmax(logits / T), as a naive token-by-token loop computes; and at the engine's sampling
temperature its log-probs of an engine-generated sequence are the ones the engine stored."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

from reference.engine.base import GenerateRequest, SamplingParams, generate
from reference.engine.builtin import BuiltinEngine
from reference.model import build_model, tiny_config
from reference.trainer.batch import Trajectory, collate
from reference.trainer.config import TrainerConfig
from reference.trainer.loss import token_logprobs
from reference.trainer.trainer import Trainer

VOCAB = 97
T = 0.7


def model(seed: int = 0):
    dims = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 16}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    return build_model(tiny_config(VOCAB, **dims, **heads, max_position_embeddings=96, initializer_range=0.1), seed)


def naive(model, ids: list[int], mask: list[int], temperature: float) -> tuple[list[float], list[float]]:
    """(log p, entropy) of each trained token ids[t] (mask[t] 1) given ids[:t] alone, one forward of the prefix per
    token, softmax(logits / temperature) in float64."""
    logps, entropies = [], []
    with torch.no_grad():
        for t in range(1, len(ids)):
            if not mask[t]:
                continue
            logits = model(input_ids=torch.tensor([ids[:t]])).logits[0, -1].double()
            logsm = torch.log_softmax(logits / temperature, dim=-1)
            logps.append(logsm[ids[t]].item())
            entropies.append(-(logsm.exp() * logsm).sum().item())
    return logps, entropies


def trajectories(behaviour=None) -> list[Trajectory]:
    """Four samples of two groups: lengths differ (padding), one has a tool output inside its answer. Their
    behaviour log-probs are `behaviour`'s at T (token by token), or -1."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i, (prompt, answer) in enumerate([(3, 6), (5, 9), (2, 4), (4, 11)]):
        ids = torch.randint(1, VOCAB, (prompt + answer,), generator=g).tolist()
        mask = [0] * prompt + [1] * answer
        if answer > 8:
            mask[prompt + 3 : prompt + 5] = [0, 0]
        n = sum(mask)
        logprobs = naive(behaviour, ids, mask, T)[0] if behaviour is not None else [-1.0] * n
        out.append(Trajectory(ids, mask, logprobs, [0] * n, i // 2, float(i % 2)))
    return out


def flat(batch, values: torch.Tensor) -> list[float]:
    return values[batch.mask > 0].tolist()


@pytest.mark.parametrize("chunk_tokens", [1, 5, 2048])
@pytest.mark.parametrize("temperature", [T, 1.6])
def test_token_logprobs_and_entropy_follow_the_temperature(chunk_tokens, temperature):
    policy, trajs = model(0), trajectories()
    batch = collate(trajs, [1.0, -1.0, 0.5, -0.5], pad_id=0)
    logp, entropy = token_logprobs(policy, batch, chunk_tokens, temperature=temperature)
    expected = [naive(policy, list(t.token_ids), list(t.generated_mask), temperature) for t in trajs]
    assert flat(batch, logp) == pytest.approx([x for lp, _ in expected for x in lp], abs=1e-5)
    assert flat(batch, entropy) == pytest.approx([x for _, h in expected for x in h], abs=1e-5)
    at_one, _ = token_logprobs(policy, batch, chunk_tokens)
    assert (logp - at_one).abs().max() > 0.01  # the temperature changes them


@pytest.mark.parametrize("off_policy", ["behaviour", "decoupled"])
def test_a_step_scores_the_policy_the_proximal_and_the_kl_reference_at_the_temperature(off_policy):
    """Behaviour log-probs of these very weights at T: every ratio and behaviour weight is 1; the step's entropy
    and KL to another reference model are the naive ones at T."""
    policy, reference = model(0), model(1)
    trajs = trajectories(behaviour=policy)
    config = TrainerConfig(temperature=T, off_policy=off_policy, kl_coef=0.1, logit_chunk_tokens=3)
    trainer = Trainer(copy.deepcopy(policy), config, pad_id=0, ref_model=copy.deepcopy(reference))
    metrics = trainer.train_step(trajs)
    assert (metrics.ratio_min, metrics.ratio_max) == (pytest.approx(1.0, abs=1e-4), pytest.approx(1.0, abs=1e-4))
    assert abs(metrics.fresh_mismatch_mean) < 1e-5
    assert metrics.is_weight_max == pytest.approx(1.0, abs=1e-4)
    logp, kl, entropy = [], [], []
    for t in trajs:
        lp, h = naive(policy, list(t.token_ids), list(t.generated_mask), T)
        ref, _ = naive(reference, list(t.token_ids), list(t.generated_mask), T)
        logp += lp
        entropy += h
        kl += [math.exp(r - p) - (r - p) - 1 for r, p in zip(ref, lp, strict=True)]
    assert metrics.entropy == pytest.approx(sum(entropy) / len(entropy), abs=1e-5)
    assert metrics.kl == pytest.approx(sum(kl) / len(kl), abs=1e-5)


def test_temperature_must_be_a_finite_positive_number():
    for bad in (0, -0.5, float("nan"), float("inf"), "hot", True):
        with pytest.raises(ValueError, match=r"TrainerConfig.temperature must be"):
            TrainerConfig(temperature=bad)
    assert TrainerConfig().temperature == 1.0


def test_the_trainer_scores_what_the_engine_sampled_at_its_temperature():
    """The built-in engine samples six requests of several lengths at T = 0.7; the trainer at the same temperature
    gets the log-probs the engine stored, token for token, in the chunked loss path, and a training step's ratios
    are 1. At temperature 1 (the raw model's) they are far off."""
    policy = model(0).eval()
    prompts = [[5, 9, 13], [7, 7, 2, 40, 41, 50, 61], [90]]

    async def run():
        with BuiltinEngine(copy.deepcopy(policy), max_batch=4, seed=0) as engine:
            requests = [
                GenerateRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=12 + 4 * i, temperature=T, seed=i))
                for i, p in enumerate(prompts * 2)
            ]
            return await asyncio.gather(*(generate(engine, r) for r in requests))

    results = asyncio.run(run())
    trajs = []
    for i, r in enumerate(results):
        ids = (*r.prompt_token_ids, *r.token_ids)
        mask = (0,) * len(r.prompt_token_ids) + (1,) * len(r.token_ids)
        trajs.append(Trajectory(ids, mask, r.logprobs, r.versions, i % 3, float(i // 3)))
    batch = collate(trajs, [0.0] * len(trajs), pad_id=0)
    stored = [lp for t in trajs for lp in t.logprobs]
    logp, _ = token_logprobs(policy, batch, 7, entropy=False, temperature=T)
    assert flat(batch, logp) == pytest.approx(stored, abs=1e-5)
    raw, _ = token_logprobs(policy, batch, 7, entropy=False)
    assert max(abs(a - b) for a, b in zip(flat(batch, raw), stored, strict=True)) > 0.05
    metrics = Trainer(copy.deepcopy(policy), TrainerConfig(temperature=T), pad_id=0).train_step(trajs)
    assert (metrics.ratio_min, metrics.ratio_max) == (pytest.approx(1.0, abs=1e-4), pytest.approx(1.0, abs=1e-4))


def test_a_trainer_at_temperature_1_scores_what_a_raw_mode_engine_stored():
    """engine.logprobs_mode raw: the engine samples at 0.7 but stores the temperature-1 model's log-probs, which the
    trainer (at temperature 1, as the runtime sets it for that mode) reproduces: a step's ratios are 1."""
    policy = model(0).eval()

    async def run():
        with BuiltinEngine(copy.deepcopy(policy), max_batch=4, seed=0, logprobs_mode="raw") as engine:
            requests = [
                GenerateRequest(f"r{i}", (5, 9, 13 + i), SamplingParams(max_tokens=10 + 3 * i, temperature=T, seed=i))
                for i in range(4)
            ]
            return await asyncio.gather(*(generate(engine, r) for r in requests))

    trajs = []
    for i, r in enumerate(asyncio.run(run())):
        mask = (0,) * len(r.prompt_token_ids) + (1,) * len(r.token_ids)
        trajs.append(Trajectory((*r.prompt_token_ids, *r.token_ids), mask, r.logprobs, r.versions, i % 2, float(i)))
    batch = collate(trajs, [0.0] * len(trajs), pad_id=0)
    logp, _ = token_logprobs(policy, batch, 7, entropy=False)
    assert flat(batch, logp) == pytest.approx([lp for t in trajs for lp in t.logprobs], abs=1e-5)
    metrics = Trainer(copy.deepcopy(policy), TrainerConfig(temperature=1.0), pad_id=0).train_step(trajs)
    assert (metrics.ratio_min, metrics.ratio_max) == (pytest.approx(1.0, abs=1e-4), pytest.approx(1.0, abs=1e-4))
