"""The chunked vocabulary projection of `token_logprobs`: the same log-probs, entropies and gradients as projecting
every trained position at once, without ever holding (or saving for the backward pass) more than one chunk's
[chunk, vocabulary] logits."""

from __future__ import annotations

import random

import pytest
import torch

from reference.model import build_model, tiny_config
from reference.trainer.batch import Trajectory, collate
from reference.trainer.loss import grpo_loss, token_logprobs

VOCAB = 97  # no other dimension of the model or the batch has this size


def model(tied: bool = True, seed: int = 0):
    config = tiny_config(VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=64, initializer_range=0.1,
                         tie_word_embeddings=tied)  # fmt: skip
    return build_model(config, seed)


def batch(seed: int = 0):
    """Six sequences of different lengths (padding), prompts and a tool-output stretch (untrained positions), one
    sequence not trained at all, both signs of advantage, behaviour log-probs around the model's."""
    rng = random.Random(seed)
    trajs = []
    for i in range(6):
        prompt, answer = rng.randint(1, 5), rng.randint(2, 11)
        ids = [rng.randrange(1, VOCAB) for _ in range(prompt + answer)]
        mask = [0] * prompt + [1] * answer
        if answer > 6:
            mask[prompt + 2 : prompt + 4] = [0, 0]  # a tool output inside the answer
        n = sum(mask)
        trajs.append(Trajectory(ids, mask, [-4.5 + rng.uniform(-1, 1) for _ in range(n)], [0] * n, i // 3,
                                float(i), trained=i != 4))  # fmt: skip
    return collate(trajs, [0.7, -0.4, 0.0, 1.2, -0.9, -0.3], pad_id=0)


def full_token_logprobs(model, batch):
    """The projection of every position at once (the trainer's computation before it was chunked)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logsm = torch.log_softmax(logits.float(), dim=-1)
    on = batch.mask > 0
    logp = logsm.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    entropy = -(logsm.exp() * logsm).sum(-1)
    return torch.where(on, logp, 0.0), torch.where(on, entropy, 0.0)


def chunk_sizes(n: int) -> list[int]:
    divisor = next(d for d in range(n // 2, 1, -1) if n % d == 0)
    return [1, divisor, divisor + 1, n, 4 * n]


def test_the_batch_has_a_trained_token_count_with_a_proper_divisor():
    n = batch().num_tokens
    assert n > 10 and chunk_sizes(n)[1] not in (1, n) and n % chunk_sizes(n)[2]


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_logprobs_and_entropies_equal_the_full_projection(tied):
    m, b = model(tied), batch()
    with torch.no_grad():
        want_logp, want_entropy = full_token_logprobs(m, b)
    for chunk in chunk_sizes(b.num_tokens):
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                logp, entropy = token_logprobs(m, b, chunk)
            torch.testing.assert_close(logp.detach(), want_logp, rtol=1e-6, atol=1e-6, msg=f"chunk {chunk}")
            torch.testing.assert_close(entropy.detach(), want_entropy, rtol=1e-6, atol=1e-6, msg=f"chunk {chunk}")
            assert bool((logp[b.mask == 0] == 0).all()) and bool((entropy[b.mask == 0] == 0).all())


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_gradients_equal_the_full_projections(tied):
    """The gradient of the whole GRPO loss (clipped surrogate, entropy bonus, KL to a reference) with respect to
    every parameter, the tied or untied output projection included."""
    b, ref = batch(), model(tied, seed=5)
    with torch.no_grad():
        ref_logp, _ = full_token_logprobs(ref, b)
    kwargs = dict(clip_eps=0.2, ratio_cap=3.0, entropy_coef=0.05, kl_coef=0.1, ref_logp=ref_logp)

    def gradients(chunk: int | None) -> dict[str, torch.Tensor]:
        m = model(tied)
        logp, entropy = full_token_logprobs(m, b) if chunk is None else token_logprobs(m, b, chunk)
        grpo_loss(logp, entropy, b, b.num_tokens, **kwargs).loss.backward()
        return {name: p.grad for name, p in m.named_parameters()}

    want = gradients(None)
    assert all(g is not None and bool(g.any()) for g in want.values())
    for chunk in chunk_sizes(b.num_tokens):
        got = gradients(chunk)
        assert got.keys() == want.keys()
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=f"{name}, chunk {chunk}")


def test_the_entropy_without_a_gradient_changes_nothing_else():
    b = batch()
    grads = []
    for entropy_grad in (True, False):
        m = model()
        logp, entropy = token_logprobs(m, b, 5, entropy_grad=entropy_grad)
        assert entropy.requires_grad == entropy_grad
        grpo_loss(logp, entropy, b, b.num_tokens, clip_eps=0.2, ratio_cap=3.0).loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_no_more_than_one_chunk_of_logits_exists_at_once():
    """Every projection onto the vocabulary (the forward pass's and the backward pass's recomputation) covers at
    most `chunk` tokens, and nothing the autograd graph keeps for the backward pass outside a chunk's
    recomputation (the weights aside) has a vocabulary-sized dimension. The unchunked projection fails both."""
    b, chunk = batch(), 4

    def record(m, run):
        projected, saved = [], []

        def project(_module, _args, out: torch.Tensor) -> None:
            if out.numel():  # the model's own call, with no position to project, is empty
                projected.append(out.shape)

        handle = m.get_output_embeddings().register_forward_hook(project)

        weights = {p.untyped_storage().data_ptr() for p in m.parameters()}

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() not in weights:  # activations, not (views of) the weights
                saved.append(tuple(t.shape))
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logp, entropy = run(m, b)
            grpo_loss(logp, entropy, b, b.num_tokens, clip_eps=0.2, ratio_cap=3.0, entropy_coef=0.01).loss.backward()
        finally:
            handle.remove()
        return projected, saved

    projected, saved = record(model(), lambda m, b: token_logprobs(m, b, chunk))
    assert len(projected) == 2 * -(-b.num_tokens // chunk)  # each chunk once forward, once recomputed backward
    assert all(shape[-1] == VOCAB and shape[:-1].numel() <= chunk for shape in projected), projected
    assert saved and not any(VOCAB in shape for shape in saved), saved

    projected, saved = record(model(), full_token_logprobs)
    assert max(shape[:-1].numel() for shape in projected) > chunk
    assert any(shape[-1] == VOCAB and torch.Size(shape[:-1]).numel() > chunk for shape in saved)


def test_the_chunk_size_must_be_a_positive_integer():
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="chunk_tokens must be an integer >= 1"):
            token_logprobs(model(), batch(), bad)
