"""The SWE probe's pass@1 proxy (`reference.trainer.swe_probe`): for each task, sampled fix turns given the
demonstration's history up to the fix, each parsed as the manager parses tool calls and its command run in a
kept checkout of the task (`FixJudge`); a sample resolves when the checkout's diff equals the demonstration's,
or else when the task's tests pass with it. Samples come from the project's built-in engine.

Sampled commands run on this machine with no isolation, as `--sandbox local` rollouts do: trusted models only.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from reference.engine.base import GenerateRequest, GenerateResult, SamplingParams, generate
from reference.engine.builtin import BuiltinEngine
from reference.manager.tools import parse_tool_calls
from reference.tokenizer import Tokenizer
from reference.trainer.swe_probe_data import Recording, RenderedEpisode, git_diff
from swebench_env.runner import LocalRunner
from swebench_env.tasks import Instance, materialize_repo

FIX_TIMEOUT_S = 20.0  # a sampled fix command
FIX_MAX_TOKENS = 512  # the longest demonstrated fix turn is 391 tokens


def sample_completions(
    model,
    prompts: Sequence[Sequence[int]],
    n: int,
    stop_ids: Sequence[int],
    max_tokens: int,
    seed: int,
    max_batch: int = 32,
    temperature: float = 1.0,
) -> list[list[GenerateResult]]:
    """`n` completions of each prompt at `temperature` (each up to and including a stop token, or `max_tokens`
    long), with their logprobs at that temperature, from the project's built-in engine (continuous batching, a KV
    cache, the prompt's KV shared by its samples) over a copy of `model`."""
    params = [
        SamplingParams(max_tokens, temperature, stop_token_ids=tuple(stop_ids), seed=seed * 1_000_003 + i)
        for i in range(len(prompts) * n)
    ]
    requests = [GenerateRequest(f"r{i}", tuple(prompts[i // n]), p) for i, p in enumerate(params)]

    async def run(engine) -> list[GenerateResult]:
        return list(await asyncio.gather(*(generate(engine, r) for r in requests)))

    with BuiltinEngine(copy.deepcopy(model), max_batch=max_batch, seed=seed) as engine:
        results = asyncio.run(run(engine))
    return [results[i * n : (i + 1) * n] for i in range(len(prompts))]


def bash_command(text: str) -> str | None:
    """The command of a reply's first tool call when it is a `bash` call with a string command, as the agent
    reads it (the manager's `parse_tool_calls`, then the call's JSON arguments)."""
    _, calls = parse_tool_calls(text)
    if not calls or calls[0]["function"]["name"] != "bash":
        return None
    try:
        command = json.loads(calls[0]["function"]["arguments"]).get("command")
    except (json.JSONDecodeError, AttributeError):
        return None
    return command if isinstance(command, str) and command.strip() else None


class FixJudge:
    """Whether a fix command resolves a task: run in a kept checkout of it (reset after each command), the diff
    compared with the demonstration's; a different non-empty diff is graded by the task's tests. Cached."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[tuple[str, str], bool] = {}

    def __call__(self, task: Instance, recording: Recording, command: str | None) -> bool:
        if command is None:
            return False
        key = (task.instance_id, command)
        if key not in self._cache:
            self._cache[key] = self._judge(task, recording, command)
        return self._cache[key]

    def _judge(self, task: Instance, recording: Recording, command: str) -> bool:
        from swebench_env.evaluation import evaluate_locally

        repo = self.root / task.instance_id
        if not repo.is_dir():
            materialize_repo(task, repo)
        try:
            LocalRunner(repo).exec(command, FIX_TIMEOUT_S)
            diff = git_diff(repo)
        finally:
            subprocess.run(["git", "checkout", "-q", "--", "."], cwd=repo, check=False)
            subprocess.run(["git", "clean", "-qfdx"], cwd=repo, check=False)
        if diff == recording.fix_diff:
            return True
        return bool(diff) and evaluate_locally(task, diff + ("" if diff.endswith("\n") else "\n")).resolved


def fix_prompt(episode: RenderedEpisode) -> tuple[int, ...]:
    return episode.token_ids[: episode.turns[episode.fix_turn][0]]


def proxy_pass_at_1(
    model, tok: Tokenizer, items, judge: FixJudge, samples: int, seed: int, temperature: float = 1.0
) -> float:
    """Mean over `items` (task, recording, episode) of the share of `samples` sampled fix turns that resolve."""
    prompts = [fix_prompt(episode) for _, _, episode in items]
    groups = sample_completions(
        model, prompts, samples, tok.stop_token_ids, FIX_MAX_TOKENS, seed, temperature=temperature
    )
    total = 0.0
    for (task, recording, _), group in zip(items, groups, strict=True):
        total += sum(judge(task, recording, bash_command(tok.decode(r.token_ids))) for r in group) / samples
    return total / len(items)
