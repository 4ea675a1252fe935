"""A deterministic multi-turn task for tests of the episode seam: a scripted chat agent, no sandbox, no model.

`ChatEpisodesTask` runs each episode as a short conversation through the trajectory manager with the
official `openai` client (in a thread, as a real agent runs): a system message, then `turns` rounds of
(the model's reply, a fake tool observation). With `rewrite_at=k`, before turn k the agent replaces the
oldest observation's text with a placeholder, as agents that trim their context do, so the session
splits into two branches that share the first reply. The reward of episode i is
`rewards[i % len(rewards)]` (None: no verdict). Its problems are numbered; nothing is learned from it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

from reference.rollout.episodes import Episode, EpisodeContext
from reference.tasks.base import Problem
from reference.tokenizer import Tokenizer, default_tokenizer


@dataclass(frozen=True)
class ChatEpisodesConfig:
    turns: int = 3  # model replies an episode
    rewrite_at: int | None = None  # before this turn (1-based), the oldest observation is trimmed from the history
    rewards: tuple[float | None, ...] = (1.0, 0.0)  # episode i earns rewards[i % len]
    max_tokens: int = 8  # per reply

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if self.rewrite_at is not None and not 2 <= self.rewrite_at <= self.turns:
            raise ValueError(f"rewrite_at must be in [2, turns={self.turns}] or None, got {self.rewrite_at}")
        if not self.rewards:
            raise ValueError("rewards must name at least one reward")


class ChatEpisodesTask:
    name = "chat-episodes"

    def __init__(self, config: ChatEpisodesConfig | None = None, **overrides) -> None:
        self.config = config or ChatEpisodesConfig(**overrides)
        self._tokenizer = default_tokenizer()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_tokens(self) -> int:
        return self.config.max_tokens

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        return [Problem(f"chat-{rng.randrange(10**6)}", "Say something.", "") for _ in range(n)]

    def held_out(self) -> list[Problem]:
        return [Problem(f"chat-held-{i}", "Say something.", "") for i in range(2)]

    async def episodes(self, problem: Problem, n: int, key: str, ctx: EpisodeContext) -> list[Episode]:
        seeds = [ctx.seed() if ctx.fixed_seed is None else ctx.episode_seed(problem.problem_id, i) for i in range(n)]
        runs = [
            asyncio.to_thread(self._episode, problem, f"{key}-e{i}", ctx.session_url(f"{key}-e{i}"), seeds[i])
            for i in range(n)
        ]
        results = await asyncio.gather(*runs)
        out = []
        for i, (sid, rids, vs) in enumerate(results):
            reward = self.config.rewards[i % len(self.config.rewards)]
            out.append(Episode(sid, tuple(rids), reward, reward == 1.0, min(vs), max(vs), len(vs)))
        return out

    def _episode(self, problem: Problem, sid: str, url: str, seed: int) -> tuple[str, list[str], list[int]]:
        """One conversation; (session id, its request ids, the versions of its generated tokens)."""
        import openai

        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        messages: list[dict] = [
            {"role": "system", "content": "You are a test agent."},
            {"role": "user", "content": problem.prompt},
        ]
        request_ids, versions = [], []
        try:
            model = client.models.list().data[0].id  # the served model's name, as agents ask for it
            for turn in range(1, self.config.turns + 1):
                if turn == self.config.rewrite_at:  # the history is rewritten: the oldest observation trimmed
                    messages[3] = {"role": "user", "content": "[trimmed]"}
                reply = client.chat.completions.create(
                    model=model, messages=messages, seed=seed + turn, max_tokens=self.config.max_tokens
                )
                trajectory = reply.model_extra["trajectory"]
                request_ids.append(trajectory["request_id"])
                versions += trajectory["versions"]
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": f"observation {turn}: {'x' * turn}"},
                ]
        finally:
            client.close()
        return sid, request_ids, versions or [0]


def naive_branch_records(store, session_ids: Sequence[str]) -> list[dict]:
    """Every branch of each session as its own record (what exporting a session's branches gives): the
    baseline the episode rule improves on, for tests."""
    from reference.export import branch_records

    return list(branch_records(store, session_ids))
