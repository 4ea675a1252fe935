"""The built-in engine's sampler: greedy or temperature + top-p, one seeded generator per request.

Each sampled token comes with its log-probability under the distribution it was drawn from (vLLM's
`logprobs_mode="processed_logprobs"`): log_softmax(logits / T) over the ids the engine may draw (`vocab_limit`),
renormalised over the top-p nucleus when top_p < 1. A trainer that divides its logits by the same T
(`TrainerConfig.temperature`) computes the same numbers where top_p is 1 and every id is allowed (the runtime's
case); the importance ratios of PPO and its off-policy corrections are then against the true behaviour policy.

Greedy rows (T = 0) report log_softmax(logits) at temperature 1, over the allowed ids: what vLLM's sampler returns
for a greedy request (`Sampler.sample` takes the argmax and computes the processed log-probs before any temperature
or top-p is applied). The sampled distribution itself is a point mass (log-prob 0), which says nothing; the
temperature-1 value is the model's own confidence, and a greedy run does not train (PPO needs T > 0).

`logprobs_mode="raw"` (vLLM's "raw_logprobs") reports every row's log_softmax(logits) at temperature 1 over the
allowed ids instead, before temperature and top-p: what a trainer scoring at temperature 1 computes, whatever the
sampling temperature. Temperature, top-p and `vocab_limit` then shape only which token is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool [B, V]: the smallest high-probability set of each row whose mass reaches top_p."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]  # the mass before it does not reach top_p yet
    return torch.zeros_like(keep).scatter(-1, order, keep)


def sample(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator],
    vocab_limit: int | None = None,
    logprobs_mode: str = "processed",
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V], and its log-probability under the distribution it was drawn from
    ("processed") or under the model at temperature 1 ("raw"; see the module docstring).

    Temperature 0 is greedy; otherwise inverse-CDF sampling from softmax(logits / T) after top-p, with
    one uniform draw from the row's generator. Ids >= `vocab_limit` are never drawn."""
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    chosen = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]; the greedy rows keep these
    rows = [i for i, t in enumerate(temperatures) if t > 0]
    if rows:
        temps = torch.tensor([temperatures[i] for i in rows], dtype=logits.dtype)
        scaled = logits[rows] / temps[:, None]
        probs = torch.softmax(scaled, dim=-1)
        processed = torch.log_softmax(scaled, dim=-1)
        if any(top_ps[i] < 1 for i in rows):
            keep = _top_p_keep(probs, torch.tensor([top_ps[i] for i in rows], dtype=probs.dtype))
            probs = probs.masked_fill(~keep, 0.0)
            processed = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
        cdf = probs.cumsum(-1)
        u = torch.stack([torch.rand((), generator=generators[i], dtype=cdf.dtype) for i in rows])
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        chosen[rows] = picked.clamp(max=logits.shape[-1] - 1)
        if logprobs_mode == "processed":
            logprobs[rows] = processed
    return chosen.tolist(), logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
