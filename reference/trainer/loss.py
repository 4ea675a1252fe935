"""GRPO's token-level loss: PPO clipped surrogate with a dual clip, against the engine's log-probs or the trainer's.

For every generated token t of a sequence with advantage A (shared by the sequence's tokens):

    old_t = logp_behaviour(t)                 off_policy "behaviour" (the default): the engine's log-prob
          = logp_prox(t)                      "tis", "decoupled": the trainer's own, before the step's update
    r_t   = exp(clamp(logp_theta(t) - old_t, -20, 20))                 importance ratio
    pg_t  = -min(r_t * A, clip(r_t, 1 - eps, 1 + eps_high) * A)         PPO clipped surrogate
    pg_t  = min(pg_t, -C * A)             if A < 0                      dual clip (cap C = ratio_cap)
    rho_t = exp(clamp(logp_prox(t) - logp_behaviour(t), -20, 20))      behaviour weight pi_prox / pi_behaviour
    w_t   = 1                                 "behaviour"
          = min(rho_t, W)                     "tis": truncated importance sampling (cap W = tis_cap)
          = rho_t if rho_t <= W else 0        "decoupled": decoupled PPO; a token past the cap is left out
    kl_t  = exp(d_t) - d_t - 1,  d_t = clamp(logp_ref(t) - logp_theta(t), -20, 20)     k3 estimator
    H_t   = -sum_v p_theta(v) log p_theta(v)                            entropy of the full distribution
    loss  = sum_t (w_t * pg_t + kl_coef * kl_t - entropy_coef * H_t) / T

Every distribution here is softmax(logits / tau), tau the temperature the engines sampled at
(`TrainerConfig.temperature`, the runtime's rollout.temperature): logp_behaviour is the engine's log-prob of the
token under what it sampled from (`reference.engine.sampling`, vLLM's "processed_logprobs"), so logp_theta,
logp_prox, logp_ref and H_t are taken at the same tau; the raw (tau = 1) log-probs of a model sampled at 0.7 would
put every ratio off 1 before any update.

w_t is a constant (no gradient flows through it). eps_high defaults to eps; a wider upper side ("clip-higher",
DAPO, Yu et al. 2025) lets a token the policy finds unlikely gain more probability per step when its advantage
is positive, which keeps the policy from collapsing onto its early favourites. T is the number of generated
tokens in the WHOLE step (every micro-batch on every data-parallel rank: a global token mean, not a mean of
per-batch means) and prompt, tool-output and padding tokens contribute nothing; a token the decoupled cap leaves
out still counts in T (as in AReaL).

"behaviour" departs from the textbook PPO: the "old policy" is the behaviour policy itself, i.e. the logprobs
the engine reported when it sampled the token (no trainer-side recomputation pass). A token sampled by
an older policy version than the one being trained (after a weight update mid-rollout, or in the
one-step-off pipeline) can have r_t far from 1; its importance weight is then truncated on both sides
of the surrogate: with A > 0 the gradient vanishes once r_t > 1 + eps_high (PPO clip), with A < 0 it
vanishes once r_t > C (dual clip, Ye et al. 2020), so no token's gradient weight r_t * |A| exceeds
max(1 + eps_high, C) * |A| and no token's loss exceeds C * |A|. The clamp at +-20 only touches tokens
whose gradient is already zero (or e^-20 small) and keeps exp finite. The engine's log-probs also differ from
the trainer's for the same weights (other kernels, other precision), so even a fresh token's r_t is not 1.

"tis" and "decoupled" recompute logp_prox, the log-prob of every generated token under the trainer's weights
before the step's update (one extra forward pass without gradient per micro-batch; with `epochs` > 1 the one
before the first epoch), and clip against it: the trust region is then around the weights being trained, and
the engine-trainer gap (staleness and numerical mismatch alike) is corrected by the weight w_t instead.
"tis" is the truncated importance sampling of verl's rollout correction and TRL (Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"): a token whose weight exceeds the cap keeps
the cap. "decoupled" is AReaL's decoupled PPO objective (Fu et al. 2025) with its `behav_imp_weight_cap`: a
token whose weight exceeds the cap is left out of the loss (w_t = 0), not truncated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from reference.trainer.batch import TokenBatch
from reference.trainer.config import OFF_POLICY, TrainerConfig

LOG_RATIO_LIMIT = 20.0
DEFAULT_LOGIT_CHUNK_TOKENS = TrainerConfig.logit_chunk_tokens  # trained tokens projected onto the vocabulary at once


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
    weight: torch.Tensor  # w_t, the behaviour weight the clipped surrogate is multiplied by (1 under "behaviour")
    capped: torch.Tensor  # bool: the tis cap truncated the weight, or the decoupled cap left the token out
    mismatch: torch.Tensor  # log pi_trainer - log pi_behaviour, the trainer's log-prob before the update
    # (logp_prox, or logp_theta where none was recomputed: the same weights in a step's first epoch)


def token_logprobs(
    model,
    batch: TokenBatch,
    chunk_tokens: int = DEFAULT_LOGIT_CHUNK_TOKENS,
    *,
    entropy: bool = True,
    entropy_grad: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target), entropy of the full distribution), both [B, L-1] float32, from one forward; 0 at the
    targets the batch does not train (`batch.mask`). `entropy` False: None for the entropy (not computed).
    p = softmax(logits / `temperature`): the distribution the engines sampled from at that temperature.

    No [tokens x vocabulary] tensor is ever held in full: the model's body runs once (its final hidden states,
    `final_hidden_states`), then the vocabulary projection, its softmax and the two statistics run on
    `chunk_tokens` trained tokens at a time. Under autograd each chunk runs inside a non-reentrant
    `torch.utils.checkpoint`, so the backward pass recomputes that chunk's logits instead of keeping them: the
    step holds at most one chunk's [chunk_tokens, V] logits at a time (with Qwen3's 151,936-token vocabulary a
    2,048-token chunk is 1.2 GB in float32, where a 32k-token episode's full logits were 20 GB a tensor). Only
    trained tokens are projected (an agent episode's prompt and tool outputs are most of its tokens). Works
    with a tied `lm_head` (the projection is the module the model itself uses). `entropy_grad` False: the
    entropy is computed for the metrics only (no gradient through it; use it when the entropy bonus is 0)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    if isinstance(temperature, bool) or not (isinstance(temperature, int | float) and 0 < temperature < math.inf):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    on = batch.mask > 0
    hidden = final_hidden_states(model, batch)[:, :-1][on]  # [N, H]: position p predicts token p + 1
    targets = batch.input_ids[:, 1:][on]
    head = model.get_output_embeddings()
    logps, entropies = [], []
    for lo in range(0, max(len(targets), 1), chunk_tokens):  # an empty batch still runs one (empty) chunk
        chunk = (hidden[lo : lo + chunk_tokens], targets[lo : lo + chunk_tokens])
        args = (head, *chunk, entropy, entropy_grad, temperature)
        if torch.is_grad_enabled():
            logp, chunk_entropy = checkpoint(_chunk_statistics, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            logp, chunk_entropy = _chunk_statistics(*args)
        logps.append(logp)
        entropies.append(chunk_entropy)
    zeros = torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device)
    logp = zeros.masked_scatter(on, torch.cat(logps))
    return logp, zeros.masked_scatter(on, torch.cat(entropies)) if entropy else None


def final_hidden_states(model, batch: TokenBatch) -> torch.Tensor:
    """[B, L, H]: the model's final (normed) hidden states, the input of its `lm_head`, from the model's own
    forward (so that wrappers such as FSDP see a normal call) with no position projected onto the vocabulary
    (`logits_to_keep` empty) and no KV cache built; the states are taken from its base model's output."""
    captured: list[torch.Tensor] = []
    handle = model.base_model.register_forward_hook(lambda _module, _args, out: captured.append(out[0]))
    try:
        model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            use_cache=False,
            logits_to_keep=batch.input_ids.new_empty(0),
        )
    finally:
        handle.remove()
    return captured[-1]


def _chunk_statistics(
    head, hidden: torch.Tensor, targets: torch.Tensor, entropy: bool, entropy_grad: bool, temperature: float
):
    """(log p(target), entropy or None), each [n], of n hidden states projected by `head`; p = softmax(logits / tau)."""
    logits = head(hidden).float()  # [n, V]
    logsm = torch.log_softmax(logits / temperature if temperature != 1 else logits, dim=-1)
    logp = logsm.gather(-1, targets[:, None])[:, 0]
    if not entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, -(logsm.exp() * logsm).sum(-1)


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
    off_policy: str = "behaviour",
    tis_cap: float = 2.0,
) -> LossOutput:
    """The loss of the module docstring for one micro-batch; `total_tokens` is the step's global T. "tis" and
    "decoupled" read logp_prox from `batch.proximal_logprobs`."""
    if total_tokens < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef {kl_coef} > 0 needs reference logprobs (ref_logp)")
    if off_policy not in OFF_POLICY:
        raise ValueError(f"unknown off_policy {off_policy!r}; choose one of {list(OFF_POLICY)}")
    behaviour, proximal = batch.behaviour_logprobs, batch.proximal_logprobs
    if off_policy != "behaviour" and proximal is None:
        raise ValueError(f"off_policy {off_policy!r} needs the proximal log-probs (batch.proximal_logprobs)")
    adv = batch.advantages[:, None]  # [B, 1]
    on = batch.mask > 0
    old = behaviour if off_policy == "behaviour" else proximal
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1 - clip_eps, 1 + (clip_eps if clip_eps_high is None else clip_eps_high)) * adv
    pg = torch.maximum(unclipped, clipped)
    cap = -ratio_cap * adv
    pg_dual = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    mismatch = (logp.detach() if proximal is None else proximal) - behaviour
    weight, capped = torch.ones_like(behaviour), torch.zeros_like(on)
    if off_policy != "behaviour":
        rho = torch.exp(mismatch.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
        capped = on & (rho > tis_cap)
        weight = rho.clamp(max=tis_cap) if off_policy == "tis" else torch.where(rho > tis_cap, 0.0, rho)
    pg_weighted = weight * pg_dual
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        d = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        kl = torch.exp(d) - d - 1
    per_token = pg_weighted + kl_coef * kl - entropy_coef * entropy
    loss = torch.where(on, per_token, 0.0).sum() / total_tokens
    return LossOutput(
        loss=loss,
        per_token=per_token.detach(),
        pg=pg_weighted.detach(),
        kl=kl.detach(),
        entropy=entropy.detach(),
        ratio=ratio.detach(),
        clipped=on & (clipped > unclipped),
        dual_clipped=on & (adv < 0) & (cap < pg),
        weight=weight,
        capped=capped,
        mismatch=mismatch,
    )
