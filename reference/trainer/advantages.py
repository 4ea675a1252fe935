"""GRPO's group-normalised advantages: each sample's reward against the other samples of its prompt.

A_i = (r_i - mean_g(r)) / (std_g(r) + eps) with `normalize_std`, else r_i - mean_g(r), where g is the
sample's group. std is the population std (divide by n, as in DeepSeekMath's GRPO). A group whose
rewards are all equal gives exactly zero advantage (it carries no signal about which sample was
better), whatever eps is; so does a group of one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[Hashable], normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """One advantage per sample, in the order given (see the module docstring for the formula)."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards for {len(group_ids)} group ids; they must match")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        values = [float(rewards[i]) for i in indices]
        mean = math.fsum(values) / len(values)
        if all(v == values[0] for v in values):
            continue  # no signal: exactly zero
        scale = 1.0
        if normalize_std:
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
            scale = 1.0 / (std + eps)
        for i, v in zip(indices, values, strict=True):
            advantages[i] = (v - mean) * scale
    return advantages
