"""GRPO's token-level loss: PPO clipped surrogate against the engine's logprobs, with a dual clip.

For every generated token t of a sequence with advantage A (shared by the sequence's tokens):

    r_t   = exp(clamp(logp_theta(t) - logp_behaviour(t), -20, 20))     importance ratio
    pg_t  = -min(r_t * A, clip(r_t, 1 - eps, 1 + eps_high) * A)         PPO clipped surrogate
    pg_t  = min(pg_t, -C * A)             if A < 0                      dual clip (cap C = ratio_cap)
    kl_t  = exp(d_t) - d_t - 1,  d_t = clamp(logp_ref(t) - logp_theta(t), -20, 20)     k3 estimator
    H_t   = -sum_v p_theta(v) log p_theta(v)                            entropy of the full distribution
    loss  = sum_t (pg_t + kl_coef * kl_t - entropy_coef * H_t) / T

eps_high defaults to eps; a wider upper side ("clip-higher", DAPO, Yu et al. 2025) lets a token the
policy finds unlikely gain more probability per step when its advantage is positive, which keeps the
policy from collapsing onto its early favourites. T is the number of generated tokens in the WHOLE
step (every micro-batch on every data-parallel rank: a global token mean, not a mean of per-batch
means) and prompt, tool-output and padding tokens contribute nothing.

Departures from the textbook PPO: the "old policy" is the behaviour policy itself, i.e. the logprobs
the engine reported when it sampled the token (no trainer-side recomputation pass). A token sampled by
an older policy version than the one being trained (after a weight update mid-rollout, or in the
one-step-off pipeline) can have r_t far from 1; its importance weight is then truncated on both sides
of the surrogate: with A > 0 the gradient vanishes once r_t > 1 + eps_high (PPO clip), with A < 0 it
vanishes once r_t > C (dual clip, Ye et al. 2020), so no token's gradient weight r_t * |A| exceeds
max(1 + eps_high, C) * |A| and no token's loss exceeds C * |A|. The clamp at +-20 only touches tokens
whose gradient is already zero (or e^-20 small) and keeps exp finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.trainer.batch import TokenBatch

LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class LossOutput:
    """The scalar to back-propagate and detached per-token tensors [B, L-1] for metrics."""

    loss: torch.Tensor  # scalar: this micro-batch's share of the step's token-mean loss
    per_token: torch.Tensor  # pg + kl_coef * kl - entropy_coef * entropy
    pg: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor  # bool: the clipped term was the active one
    dual_clipped: torch.Tensor  # bool: the dual clip's cap was the active one


def token_logprobs(model, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy of the full distribution), both [B, L-1] float32, from one forward; 0 at the
    targets no row of the batch trains (`batch.mask`). The vocabulary projection and its softmax run only at
    the positions some row trains (the model's `logits_to_keep`): an agent episode's prompt and tool outputs
    are most of its tokens, and [B, L, V] logits are most of a step's memory."""
    keep = (batch.mask > 0).any(0).nonzero()[:, 0]  # target positions (hidden position p predicts token p+1)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep).logits
    logsm = torch.log_softmax(logits.float(), dim=-1)  # [B, K, V]
    targets = batch.input_ids[:, 1:].index_select(1, keep)
    shape = batch.mask.shape
    logp = logsm.new_zeros(shape).index_copy(1, keep, logsm.gather(-1, targets[..., None])[..., 0])
    entropy = logsm.new_zeros(shape).index_copy(1, keep, -(logsm.exp() * logsm).sum(-1))
    return logp, entropy


def grpo_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    batch: TokenBatch,
    total_tokens: int,
    *,
    clip_eps: float,
    ratio_cap: float,
    clip_eps_high: float | None = None,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> LossOutput:
    """The loss of the module docstring for one micro-batch; `total_tokens` is the step's global T."""
    if total_tokens < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef {kl_coef} > 0 needs reference logprobs (ref_logp)")
    adv = batch.advantages[:, None]  # [B, 1]
    ratio = torch.exp((logp - batch.behaviour_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1 - clip_eps, 1 + (clip_eps if clip_eps_high is None else clip_eps_high)) * adv
    pg = torch.maximum(unclipped, clipped)
    cap = -ratio_cap * adv
    pg_dual = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        d = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        kl = torch.exp(d) - d - 1
    per_token = pg_dual + kl_coef * kl - entropy_coef * entropy
    on = batch.mask > 0
    loss = torch.where(on, per_token, 0.0).sum() / total_tokens
    return LossOutput(
        loss=loss,
        per_token=per_token.detach(),
        pg=pg_dual.detach(),
        kl=kl.detach(),
        entropy=entropy.detach(),
        ratio=ratio.detach(),
        clipped=on & (clipped > unclipped),
        dual_clipped=on & (adv < 0) & (cap < pg),
    )
