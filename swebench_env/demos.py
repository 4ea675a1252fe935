"""Demonstrations: the bash commands an agent would run to solve a task, as data for a supervised warm start.

A demonstration is a list of steps, each a `thought` (the agent's reasoning) and one bash `command`
run from the repository's root in a fresh shell. The last step submits, by the convention of
mini-swe-agent-style agents: its command is `SUBMIT_COMMAND`, whose output is the marker line and
then the patch (`git diff --cached` after `git add -A`).

Observations are not stored: their exact text depends on the sandbox (paths, timings, the shell's
banner), so whoever builds training conversations replays the commands in the sandbox the agent
will use (`replay` does it in a local checkout) and takes the outputs from there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SUBMIT_COMMAND = f"echo {SUBMIT_MARKER} && git add -A && git diff --cached"


@dataclass(frozen=True)
class Step:
    thought: str
    command: str  # one bash command line (may hold a heredoc), run from the repository's root


@dataclass(frozen=True)
class Demonstration:
    instance_id: str
    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        if not self.steps or self.steps[-1].command != SUBMIT_COMMAND:
            raise ValueError(f"demonstration {self.instance_id!r}: the last step must run {SUBMIT_COMMAND!r}")

    def to_dict(self) -> dict:
        return {
            "instance_id": self.instance_id,
            "steps": [{"thought": s.thought, "command": s.command} for s in self.steps],
        }

    @classmethod
    def from_dict(cls, record: dict) -> Demonstration:
        try:
            steps = tuple(Step(str(s["thought"]), str(s["command"])) for s in record["steps"])
            return cls(str(record["instance_id"]), steps)
        except (KeyError, TypeError) as e:
            raise ValueError(f"a demonstration needs 'instance_id' and 'steps' of thought/command: {e}") from None


@dataclass(frozen=True)
class StepResult:
    command: str
    returncode: int  # -1: timed out
    output: str  # stdout and stderr together


def load_demonstrations(path: Path | str) -> list[Demonstration]:
    """The demonstrations in a JSONL file, one a line."""
    demos = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                demos.append(Demonstration.from_dict(json.loads(line)))
            except (ValueError, json.JSONDecodeError) as e:
                raise ValueError(f"{path} line {number}: {e}") from None
    return demos


def dump_demonstrations(demos: Iterable[Demonstration], path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d.to_dict(), ensure_ascii=False) + "\n" for d in demos), encoding="utf-8")
    return path


def replay(demo: Demonstration, repo: Path, timeout_s: float = 60.0) -> list[StepResult]:
    """Run every step of `demo` with bash in the checkout `repo`; a failing command is a result, not an error.

    `python` resolves to this interpreter, so the commands run against the packages it has (pytest).
    """
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    results = []
    for step in demo.steps:
        try:
            done = subprocess.run(
                ["bash", "-c", step.command], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s
            )
            results.append(StepResult(step.command, done.returncode, done.stdout + done.stderr))
        except subprocess.TimeoutExpired:
            results.append(StepResult(step.command, -1, f"timed out after {timeout_s:g} s"))
    return results


def submitted_patch(results: list[StepResult]) -> str | None:
    """The patch the submit step printed after the marker line, or None if nothing was submitted."""
    for result in results:
        first, _, rest = result.output.partition("\n")
        if result.returncode == 0 and first.strip() == SUBMIT_MARKER:
            return rest
    return None
