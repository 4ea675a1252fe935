"""Whether a patch resolves a task: the pure rules, and a local runner that applies them without Docker.

The rules follow SWE-bench's harness: the candidate patch is applied to the base commit, the test
files named by `test_patch` are reset to the base commit (so a patch cannot edit the tests that judge
it) and the test patch is applied, then those test files run. A task is resolved only when every
FAIL_TO_PASS and every PASS_TO_PASS test passes; a test missing from the log counts as not passed.

The pure parts (`judged_files`, `pytest_command`, `parse_pytest_log`, `grade`) are what a Docker grader
reuses: it runs the same command in a container and parses its log the same way. `evaluate_locally`
is the plain-subprocess version the suite generator uses; it runs the repository's code on this
machine, so use it only on trusted tasks (the shipped suite, your own).

Only pytest repositories are handled: official SWE-bench repositories such as django or sympy need
their own test command and log parser per repository, which a grader adds beside `pytest_command`.
"""

from __future__ import annotations

import enum
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from swebench_env.git import GitError, git
from swebench_env.tasks import Task, materialize_repo

DEFAULT_TEST_TIMEOUT_S = 300.0
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_PYTEST_ARGS = ("-m", "pytest", "-rA", "-p", "no:cacheprovider", "--no-header", "-q")
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\S+)(?: - .*)?$", re.MULTILINE)


class Outcome(enum.Enum):
    PASSED = "PASSED"
    FAILED = "FAILED"
    ERROR = "ERROR"
    SKIPPED = "SKIPPED"
    XFAIL = "XFAIL"
    XPASS = "XPASS"


PASSING = frozenset({Outcome.PASSED, Outcome.XFAIL})  # as SWE-bench counts them


@dataclass(frozen=True)
class Grade:
    resolved: bool  # every FAIL_TO_PASS and PASS_TO_PASS test passed: the reward is 1
    fail_to_pass: tuple[int, int]  # (passed, total)
    pass_to_pass: tuple[int, int]  # (passed, total)


@dataclass(frozen=True)
class Evaluation:
    instance_id: str
    applied: bool  # the candidate patch applied cleanly (if not, nothing ran and `resolved` is False)
    statuses: Mapping[str, Outcome]  # test id -> status, from the log
    grade: Grade
    log: str  # git apply's complaint, or pytest's output

    @property
    def resolved(self) -> bool:
        return self.grade.resolved


def patch_files(patch: str) -> list[str]:
    """The paths a unified git diff touches, in order, each once."""
    paths: list[str] = []
    for a, b in _DIFF_FILE.findall(patch):
        for p in (a, b):
            if p not in paths and p != "/dev/null":
                paths.append(p)
    return paths


def judged_files(task: Task) -> list[str]:
    """The test files that judge `task`: those its test patch touches."""
    return patch_files(task.test_patch)


def pytest_command(task: Task, python: str = "python") -> list[str]:
    """The argv that runs `task`'s test files with a summary line per test (`-rA`) that `parse_pytest_log` reads."""
    return [python, *_PYTEST_ARGS, *judged_files(task)]


def parse_pytest_log(log: str) -> dict[str, Outcome]:
    """Test id -> status from the short summary of `pytest -rA`; a later line for the same id wins."""
    return {test_id: Outcome(word) for word, test_id in _SUMMARY.findall(log) if "::" in test_id}


def grade(task: Task, statuses: Mapping[str, Outcome]) -> Grade:
    """SWE-bench's rule: resolved when every FAIL_TO_PASS and PASS_TO_PASS test passed."""
    f2p = sum(statuses.get(t) in PASSING for t in task.FAIL_TO_PASS)
    p2p = sum(statuses.get(t) in PASSING for t in task.PASS_TO_PASS)
    resolved = f2p == len(task.FAIL_TO_PASS) and p2p == len(task.PASS_TO_PASS)
    return Grade(resolved, (f2p, len(task.FAIL_TO_PASS)), (p2p, len(task.PASS_TO_PASS)))


def apply_patch(repo: Path, patch: str, timeout_s: float = 60.0) -> str | None:
    """Apply `patch` to the work tree of `repo`; None on success, else git's complaint (a result, not an error)."""
    if not patch.strip():
        return None
    try:
        git("apply", "--whitespace=nowarn", "-", cwd=repo, input_text=patch, timeout_s=timeout_s)
    except GitError as e:
        return str(e)
    return None


def run_pytest(
    repo: Path, paths: list[str], timeout_s: float = DEFAULT_TEST_TIMEOUT_S
) -> tuple[dict[str, Outcome], str]:
    """Run pytest with this Python on `paths` in `repo`: (test id -> outcome, log). A timeout keeps what ran."""
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, *_PYTEST_ARGS, *paths]
    try:
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return parse_pytest_log(out), out + f"\n[tests timed out after {timeout_s:g} s]"
    log = done.stdout + done.stderr
    return parse_pytest_log(log), log


def run_tests(task: Task, repo: Path, timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> tuple[dict[str, Outcome], str]:
    """Reset the test files, apply the test patch and run the tests in the checkout `repo`: (statuses, log)."""
    at_base = [p for p in judged_files(task) if _exists_at(repo, task.base_commit, p)]
    if at_base:
        git("checkout", "-q", task.base_commit, "--", *at_base, cwd=repo)
    for path in set(judged_files(task)) - set(at_base):
        (repo / path).unlink(missing_ok=True)  # the test patch creates it; a candidate's version must not block that
    problem = apply_patch(repo, task.test_patch)
    if problem is not None:
        raise GitError(f"instance {task.instance_id!r}: its test patch does not apply: {problem}")
    return run_pytest(repo, judged_files(task), timeout_s)


def _exists_at(repo: Path, commit: str, path: str) -> bool:
    try:
        git("cat-file", "-e", f"{commit}:{path}", cwd=repo)
    except GitError:
        return False
    return True


def evaluate_in(task: Task, repo: Path, patch: str, timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> Evaluation:
    """Apply `patch` to the fresh checkout `repo` of `task`, run its tests there and grade them."""
    problem = apply_patch(repo, patch)
    if problem is not None:
        return Evaluation(task.instance_id, False, {}, grade(task, {}), problem)
    statuses, log = run_tests(task, repo, timeout_s)
    return Evaluation(task.instance_id, True, statuses, grade(task, statuses), log)


def evaluate_locally(task: Task, patch: str, timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> Evaluation:
    """Check out `task` in a temporary folder, apply `patch`, run the tests with this Python, grade."""
    with tempfile.TemporaryDirectory(prefix=f"swe-{task.instance_id}-") as tmp:
        repo = materialize_repo(task, Path(tmp) / "repo")
        return evaluate_in(task, repo, patch, timeout_s)
