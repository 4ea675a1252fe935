"""The built-in engine's sampler: greedy or temperature + top-p, one seeded generator per request.

Each sampled token comes with its RAW model log-probability (log_softmax of the unscaled logits:
temperature 1, no top-p, no vocab mask), i.e. what a trainer re-scoring the sequence with
`reference.model.score_logprobs` computes. Temperature, top-p and `vocab_limit` shape only which
token is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside the smallest high-probability set whose mass reaches top_p (per row)."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]  # the mass before it already reaches top_p
    return torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


def sample(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator],
    vocab_limit: int | None = None,
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V], and its raw (temperature-1, unfiltered) logprob.

    Temperature 0 is greedy; otherwise inverse-CDF sampling from softmax(logits / T) after top-p, with
    one uniform draw from the row's generator. Ids >= `vocab_limit` are never drawn."""
    raw = torch.log_softmax(logits, dim=-1)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    chosen = logits.argmax(dim=-1)
    rows = [i for i, t in enumerate(temperatures) if t > 0]
    if rows:
        temps = torch.tensor([temperatures[i] for i in rows], dtype=logits.dtype)
        probs = torch.softmax(logits[rows] / temps[:, None], dim=-1)
        if any(top_ps[i] < 1 for i in rows):
            probs = _top_p_filter(probs, torch.tensor([top_ps[i] for i in rows], dtype=probs.dtype))
        cdf = probs.cumsum(-1)
        u = torch.stack([torch.rand((), generator=generators[i], dtype=cdf.dtype) for i in rows])
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        chosen[rows] = picked.clamp(max=logits.shape[-1] - 1)
    return chosen.tolist(), raw.gather(-1, chosen[:, None])[:, 0].tolist()
