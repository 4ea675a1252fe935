"""The SWE probe's data (`reference.trainer.swe_probe`): each demonstration's outputs, recorded step by step in a
fresh local checkout (`Recording`, cached as JSON), and its episode rendered as the manager stores the built-in
agent's (`render_episode`: the agent's messages through the manager's own `ChatRenderer`, which splices each
earlier reply back as the ids the engine produced).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from reference.manager.chat import ChatRenderer
from reference.manager.tools import parse_tool_calls
from reference.tokenizer import Tokenizer
from swebench_env.agent import TOOLS, AgentConfig, instance_messages, observation
from swebench_env.demos import Demonstration
from swebench_env.runner import LocalRunner
from swebench_env.scripted import step_message
from swebench_env.tasks import Instance, materialize_repo

STEP_TIMEOUT_S = 60.0  # each demonstration command while recording (the agent's default command timeout)


@dataclass(frozen=True)
class Recording:
    """A demonstration's outputs in a fresh checkout: per step (exit code, output, timed out); the first step
    that changes the checkout (the fix) and the diff it leaves."""

    outputs: tuple[tuple[int, str, bool], ...]
    fix_step: int
    fix_diff: str


def git_diff(repo: Path) -> str:
    """The checkout's uncommitted changes, as `git diff` prints them."""
    done = subprocess.run(["git", "diff", "--no-color"], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout


def record_demonstration(task: Instance, demo: Demonstration) -> Recording:
    """Run `demo` step by step in a fresh checkout of `task` (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix=f"swe-probe-{task.instance_id}-") as tmp:
        repo = materialize_repo(task, Path(tmp) / "repo")
        runner, outputs, fix_step, fix_diff = LocalRunner(repo), [], -1, ""
        for k, step in enumerate(demo.steps[:-1]):  # the last step submits: the agent never runs it
            result = runner.exec(step.command, STEP_TIMEOUT_S)
            outputs.append((result.exit_code, result.output, result.timed_out))
            if fix_step < 0 and (diff := git_diff(repo)):
                fix_step, fix_diff = k, diff
    if fix_step < 0:
        raise ValueError(f"the demonstration of {task.instance_id!r} changes nothing")
    return Recording(tuple(outputs), fix_step, fix_diff)


def load_recordings(pairs: Sequence[tuple[Instance, Demonstration]], path: Path) -> dict[str, Recording]:
    """Every pair's `Recording`, from the JSON cache at `path`; missing ones are recorded and added."""
    cached = json.loads(path.read_text()) if path.is_file() else {}
    missing = [(t, d) for t, d in pairs if t.instance_id not in cached]
    for task, demo in missing:
        r = record_demonstration(task, demo)
        cached[task.instance_id] = {"outputs": r.outputs, "fix_step": r.fix_step, "fix_diff": r.fix_diff}
    if missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, ensure_ascii=False))
    return {
        t.instance_id: Recording(
            tuple(map(tuple, cached[t.instance_id]["outputs"])),
            cached[t.instance_id]["fix_step"],
            cached[t.instance_id]["fix_diff"],
        )
        for t, _ in pairs
    }


@dataclass(frozen=True)
class RenderedEpisode:
    instance_id: str
    token_ids: tuple[int, ...]  # the final request's prompt and completion: the stored branch
    generated_mask: tuple[int, ...]  # 1 on each assistant turn's tokens (its <|im_end|> included)
    turns: tuple[tuple[int, int], ...]  # [start, end) of each assistant turn in token_ids
    fix_turn: int  # index into turns of the turn that fixes the code


def render_episode(
    task: Instance, demo: Demonstration, recording: Recording, tok: Tokenizer, config: AgentConfig | None = None
) -> RenderedEpisode:
    """The token ids the manager records when the built-in agent plays `demo` (see the module docstring): the
    messages are built as `BashAgent` builds them and rendered by the manager's `ChatRenderer`, which splices
    each earlier reply back as the ids the (demonstration) engine produced."""
    config = config or AgentConfig()
    renderer, messages = ChatRenderer(tok), instance_messages(task, config)
    turns: list[tuple[int, int]] = []
    ids: list[int] = []
    for k, step in enumerate(demo.steps):
        prompt = renderer.render(messages, TOOLS)
        assert prompt[: len(ids)] == ids, "a session's prompt extends its previous request"
        text = step_message(step)
        completion = [*tok.encode(text), tok.im_end_id]
        renderer.remember(text, completion)
        turns.append((len(prompt), len(prompt) + len(completion)))
        ids = prompt + completion
        content, calls = parse_tool_calls(text)
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        if k == len(demo.steps) - 1:
            break
        code, output, timed_out = recording.outputs[k]
        seen = observation(code, output, timed_out, config)
        messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": seen})
    mask = [0] * len(ids)
    for start, end in turns:
        mask[start:end] = [1] * (end - start)
    return RenderedEpisode(task.instance_id, tuple(ids), tuple(mask), tuple(turns), recording.fix_step)


@dataclass(frozen=True)
class Data:
    """The rendered suite: (task, recording, episode) per task of each split."""

    train: list
    held_out: list


def load_data(tok: Tokenizer, cache: Path, config: AgentConfig | None = None) -> Data:
    from swebench_env.suite import load_suite, load_suite_demonstrations

    splits = {}
    for split in ("train", "held_out"):
        pairs = list(zip(load_suite(split), load_suite_demonstrations(split), strict=True))
        recordings = load_recordings(pairs, cache)
        splits[split] = [
            (t, recordings[t.instance_id], render_episode(t, d, recordings[t.instance_id], tok, config))
            for t, d in pairs
        ]
    return Data(splits["train"], splits["held_out"])
