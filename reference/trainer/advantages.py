"""GRPO's group-normalised advantages: each sample's reward against the other samples of its prompt.

A_i = (r_i - mean_g(r)) / (std_g(r) + eps) with `normalize_std`, else r_i - mean_g(r), where g is the
sample's group. std is the population std (divide by n, as in DeepSeekMath's GRPO). A group whose
rewards are all equal gives exactly zero advantage (it carries no signal about which sample was
better), whatever eps is; so does a group of one.

A sample is an episode: an agent's episode may come as several records (one per rewrite of its
history, `reference.rollout.episodes`) that share an episode id and a reward. The mean and std are
taken over episodes, each counted once, and every record gets its episode's advantage.

`negative_weight` (w, in [0, 1]) scales the advantages below zero after the above: 1 is GRPO as written; 0
trains only on the episodes better than their group's mean (reward-weighted self-imitation, as in RAFT and
the "positive sample reinforcement" of Zhu et al. 2025). The mean is still taken over every episode, so a
group that all succeeds or all fails still carries no signal.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[Hashable],
    normalize_std: bool = True,
    eps: float = 1e-6,
    episode_ids: Sequence[Hashable | None] | None = None,
    negative_weight: float = 1.0,
) -> list[float]:
    """One advantage per record, in the order given (see the module docstring for the formula). `episode_ids`:
    records with the same (group, episode id) are one episode; None (or no list) makes a record its own."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards for {len(group_ids)} group ids; they must match")
    if episode_ids is not None and len(episode_ids) != len(rewards):
        raise ValueError(f"{len(episode_ids)} episode ids for {len(rewards)} rewards; they must match")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if not 0 <= negative_weight <= 1:
        raise ValueError(f"negative_weight must be in [0, 1], got {negative_weight}")
    members = _episodes(rewards, group_ids, episode_ids)
    advantages = [0.0] * len(rewards)
    for episodes in members.values():
        values = [reward for reward, _ in episodes.values()]
        mean = math.fsum(values) / len(values)
        if all(v == values[0] for v in values):
            continue  # no signal: exactly zero
        scale = 1.0
        if normalize_std:
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
            scale = 1.0 / (std + eps)
        for reward, indices in episodes.values():
            advantage = (reward - mean) * scale
            for i in indices:
                advantages[i] = advantage * negative_weight if advantage < 0 else advantage
    return advantages


def _episodes(rewards, group_ids, episode_ids) -> dict[Hashable, dict[Hashable, tuple[float, list[int]]]]:
    """group -> episode -> (its reward, the indices of its records); ValueError if an episode's records
    disagree on the reward."""
    members: dict[Hashable, dict[Hashable, tuple[float, list[int]]]] = defaultdict(dict)
    for i, g in enumerate(group_ids):
        episode = episode_ids[i] if episode_ids is not None and episode_ids[i] is not None else ("#record", i)
        reward, indices = members[g].setdefault(episode, (float(rewards[i]), []))
        if float(rewards[i]) != reward:
            raise ValueError(f"episode {episode!r} of group {g!r} has records with rewards {reward} and {rewards[i]}")
        indices.append(i)
    return members
