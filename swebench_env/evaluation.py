"""Whether a patch resolves a task: the pure rules, and a local runner that applies them without Docker.

The rules follow SWE-bench's harness (`swebench.harness.grading`): the candidate patch is applied to
the base commit, the test files named by `test_patch` are reset to the base commit (so a patch cannot
edit the tests that judge it) and the test patch is applied, then those test files run. A task is
resolved only when every FAIL_TO_PASS test passed (PASSED or XFAIL) and every PASS_TO_PASS test passed
or was skipped; a test missing from the log counts as failed. A test id that SWE-bench's data truncated
mid-parameter (more `[` than `]`) matches the log's ids that start with it, when they agree.

The log of a graded run uses SWE-bench's markers (`>>>>> Applied Patch`, `>>>>> Start Test Output`,
`>>>>> End Test Output`, `>>>>> Test Exit Code: N`, ...) so that the `swebench` package's own
grading reads it too; `read_eval_log` applies its rules for a log it cannot trust: a patch that did
not apply, a timeout, no test output, or a non-zero test exit with no failing test listed (a patch
can print its own PASSED lines) give no test statuses at all, so nothing passes.

The pure parts (`judged_files`, `pytest_command`, `parse_pytest_log`, `grade`, `read_eval_log`) are
what the Docker grader (`grading.py`) uses. `evaluate_locally` is the plain-subprocess version the
suite generator uses; it runs the repository's code on this machine, so use it only on trusted tasks
(the shipped suite, your own).

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
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) +(\S+)", re.MULTILINE)
_SKIP_COUNT = re.compile(r"\[\d+\]$")  # `SKIPPED [2] path:line: reason`: a count, not a test id
# SWE-bench's log markers (swebench.harness.constants), written by the grader's script
APPLY_PATCH_FAIL = ">>>>> Patch Apply Failed"
APPLY_PATCH_PASS = ">>>>> Applied Patch"
RESET_FAILED = ">>>>> Reset Failed"
TESTS_ERROR = ">>>>> Tests Errored"
TESTS_TIMEOUT = ">>>>> Tests Timed Out"
START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
TEST_EXIT_CODE = ">>>>> Test Exit Code"
_UNTRUSTED = {
    APPLY_PATCH_FAIL: "the patch did not apply",
    RESET_FAILED: "the test files could not be reset",
    TESTS_ERROR: "the tests errored",
    TESTS_TIMEOUT: "the tests timed out",
}
_EXIT_CODE = re.compile(rf"{re.escape(TEST_EXIT_CODE)}:\s*(-?\d+)")


class Outcome(enum.Enum):
    PASSED = "PASSED"
    FAILED = "FAILED"
    ERROR = "ERROR"
    SKIPPED = "SKIPPED"
    XFAIL = "XFAIL"
    XPASS = "XPASS"


PASSING = frozenset({Outcome.PASSED, Outcome.XFAIL})  # as SWE-bench counts them
MAINTAINED = PASSING | {Outcome.SKIPPED}  # a PASS_TO_PASS test that was skipped is not a regression


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
    log: str  # git apply's complaint, or pytest's output (in Docker: the whole graded run's log)
    problem: str | None = None  # why the log's test results were not trusted (see `read_eval_log`)

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
    """Test id -> status from the short summary of `pytest -rA` (a line per test: `STATUS id[ - reason]`), read
    as SWE-bench's `parse_log_pytest` reads it: the id is the first word after the status; a later line wins."""
    return {
        test_id: Outcome(word)
        for word, test_id in _SUMMARY.findall(log)
        if not (word == "SKIPPED" and _SKIP_COUNT.fullmatch(test_id))
    }


def status_of(test_id: str, statuses: Mapping[str, Outcome]) -> Outcome | None:
    """`test_id`'s status; for an id truncated mid-parameter, that of the ids starting with it when they agree."""
    if test_id in statuses:
        return statuses[test_id]
    if test_id.count("[") > test_id.count("]"):
        matches = [s for t, s in statuses.items() if t.startswith(test_id)]
        if matches and len({s in PASSING for s in matches}) == 1:
            return matches[0]
    return None


def passed(task_tests: tuple[str, ...], statuses: Mapping[str, Outcome], ok: frozenset[Outcome]) -> list[str]:
    """The tests of `task_tests` whose status is in `ok`."""
    return [t for t in task_tests if status_of(t, statuses) in ok]


def grade(task: Task, statuses: Mapping[str, Outcome]) -> Grade:
    """SWE-bench's rule: resolved when every FAIL_TO_PASS test passed and every PASS_TO_PASS test passed or
    was skipped."""
    f2p = len(passed(task.FAIL_TO_PASS, statuses, PASSING))
    p2p = len(passed(task.PASS_TO_PASS, statuses, MAINTAINED))
    resolved = f2p == len(task.FAIL_TO_PASS) and p2p == len(task.PASS_TO_PASS)
    return Grade(resolved, (f2p, len(task.FAIL_TO_PASS)), (p2p, len(task.PASS_TO_PASS)))


def read_eval_log(log: str, parse=parse_pytest_log) -> tuple[dict[str, Outcome], str | None]:
    """The test statuses of a graded run's log in SWE-bench's format, and why they are empty when the log
    cannot be trusted (None when it can): SWE-bench's `get_logs_eval` rules, described in the module docstring."""
    for marker, why in _UNTRUSTED.items():
        if marker in log:
            return {}, why
    if START_TEST_OUTPUT not in log or END_TEST_OUTPUT not in log:
        return {}, "the log has no test output"
    statuses = parse(log.split(START_TEST_OUTPUT, 1)[1].split(END_TEST_OUTPUT, 1)[0]) or parse(log)
    if not statuses:
        return {}, "no test results in the log"
    code = _EXIT_CODE.search(log)
    failing = {Outcome.FAILED, Outcome.ERROR}
    if code and int(code.group(1)) != 0 and not failing & set(statuses.values()):
        return {}, f"the tests exited with status {code.group(1)} but the log lists no failing test"
    return statuses, None


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
