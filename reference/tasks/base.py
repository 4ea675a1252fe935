"""The task seam: problems in, rewarded episodes out, with a held-out split.

A task draws training problems (`sample_train`), keeps a fixed held-out list, and runs episodes of a
problem (`episodes`, the seam of `reference.rollout.episodes`): the group rollout never looks further. A
single-turn task (`SingleTurn`) runs an episode as one request and is verifiable by code: `grade`
compares a completion string with the problem's answer and returns a dense reward in [0, 1] and whether
it was an exact match. Prompts are raw strings sent to the trajectory manager's `/completions` endpoint
without a chat template; `max_tokens` is the answer's length in tokens. A problem may name its own
`max_tokens` (at most the task's, which sizes the model's context) and ask for `ignore_eos`: stop tokens
are then ordinary tokens and every sample is exactly `max_tokens` long (a throughput workload forces its
response lengths that way). `sample_train` draws from the training split only; `held_out` is a fixed
list of problems that training never sees.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from reference.rollout.episodes import Episode, EpisodeContext
from reference.tokenizer import Tokenizer


@dataclass(frozen=True)
class Problem:
    problem_id: str  # stable across runs; doubles as the GRPO group's task id
    prompt: str
    answer: str
    max_tokens: int | None = None  # tokens to generate; None: the task's `max_tokens`
    ignore_eos: bool = False  # generate exactly `max_tokens` tokens: stop tokens do not end a sample


@dataclass(frozen=True)
class Grade:
    reward: float  # in [0, 1]
    exact: bool  # the whole answer was right


class Task(Protocol):
    name: str

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_tokens(self) -> int:
        """Tokens to generate per completion (the answer's length)."""
        ...

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]: ...

    def held_out(self) -> list[Problem]: ...

    async def episodes(self, problem: Problem, n: int, key: str, ctx: EpisodeContext) -> list[Episode]:
        """`n` episodes of `problem`, in that order, each with its reward (None: no verdict). Their sessions are
        `key` or start with it (`key` is new at every call); `ctx` gives the manager and the sampling settings."""
        ...


class SingleTurn:
    """For a task whose episode is one request graded by `grade(problem, completion) -> Grade`: the group's
    episodes are one `/completions` request with `n` choices (`single_turn_episodes`)."""

    async def episodes(self, problem: Problem, n: int, key: str, ctx: EpisodeContext) -> list[Episode]:
        return await single_turn_episodes(self, problem, n, key, ctx)


async def single_turn_episodes(task: Task, problem: Problem, n: int, key: str, ctx: EpisodeContext) -> list[Episode]:
    """`n` one-request episodes of `problem`: one `/completions` request with `n` choices (the raw prompt, no
    chat template) in session `key`, each choice graded by `task.grade`."""
    body = {
        "prompt": problem.prompt,
        "max_tokens": problem.max_tokens or task.max_tokens,
        "ignore_eos": problem.ignore_eos,
        "n": n,
        "temperature": ctx.temperature,
        "seed": ctx.seed() if ctx.fixed_seed is None else ctx.episode_seed(problem.problem_id, 0),
    }
    answer = await ctx.post(f"/s/{key}/v1/completions", body)
    episodes = []
    for choice in answer["choices"]:
        t = choice["trajectory"]
        grade = task.grade(problem, choice["text"])
        versions = t["versions"] or [0]
        reason = "finished" if choice.get("finish_reason") == "stop" else str(choice.get("finish_reason"))
        episodes.append(
            Episode(
                key,
                (t["request_id"],),
                grade.reward,
                grade.exact,
                min(versions),
                max(versions),
                len(t["token_ids"]),
                reason,
                {"branch_id": t["branch_id"]},
            )
        )
    return episodes
