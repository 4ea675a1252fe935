"""Check that tasks are well-formed by running them: the checks every shipped task passes.

For each task, in temporary checkouts and with this machine's Python (no Docker):
- the empty patch: every FAIL_TO_PASS test fails and every PASS_TO_PASS test passes (so the tests
  really expose the bug, and the task is not resolved without a fix);
- the gold patch resolves the task;
- the gold patch touches only source files and the test patch only test files;
- the demonstration, replayed command by command, submits a patch that resolves the task.
A problem is reported as text, never raised, so one bad task does not hide the others.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from swebench_env.demos import Demonstration, replay, submitted_patch
from swebench_env.evaluation import PASSING, evaluate_locally, patch_files
from swebench_env.tasks import Instance, materialize_repo


@dataclass(frozen=True)
class TaskCheck:
    instance_id: str
    problems: tuple[str, ...]  # empty: the task passed every check
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems


def check_task(task: Instance, demo: Demonstration | None = None) -> TaskCheck:
    """Run the checks above on `task` (and on `demo` when given)."""
    start = time.perf_counter()
    problems = _patch_shape(task)
    empty = evaluate_locally(task, "")
    still_pass = [t for t in task.FAIL_TO_PASS if empty.statuses.get(t) in PASSING]
    broken = [t for t in task.PASS_TO_PASS if empty.statuses.get(t) not in PASSING]
    if still_pass:
        problems.append(f"FAIL_TO_PASS tests pass without a fix: {still_pass}")
    if broken:
        problems.append(f"PASS_TO_PASS tests fail at the base commit: {broken}")
    if empty.resolved:
        problems.append("the empty patch resolves the task")
    gold = evaluate_locally(task, task.patch)
    if not gold.resolved:
        problems.append(f"the gold patch does not resolve the task ({gold.grade}): {gold.log[-1500:]}")
    if demo is not None:
        problems.extend(_check_demo(task, demo))
    return TaskCheck(task.instance_id, tuple(problems), time.perf_counter() - start)


def _patch_shape(task: Instance) -> list[str]:
    problems = []
    tests_in_gold = [p for p in patch_files(task.patch) if _is_test_path(p)]
    sources_in_tests = [p for p in patch_files(task.test_patch) if not _is_test_path(p)]
    if tests_in_gold:
        problems.append(f"the gold patch edits test files {tests_in_gold}")
    if sources_in_tests:
        problems.append(f"the test patch edits non-test files {sources_in_tests}")
    return problems


def _is_test_path(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.startswith(("tests/", "test/")) or "/tests/" in path or name.startswith("test_")


def _check_demo(task: Instance, demo: Demonstration) -> list[str]:
    if demo.instance_id != task.instance_id:
        return [f"the demonstration is for {demo.instance_id!r}"]
    with tempfile.TemporaryDirectory(prefix=f"demo-{task.instance_id}-") as tmp:
        results = replay(demo, materialize_repo(task, Path(tmp) / "repo"))
    patch = submitted_patch(results)
    if not patch:
        return [f"the demonstration submits no patch; last output: {results[-1].output[-500:]!r}"]
    outcome = evaluate_locally(task, patch)
    if not outcome.resolved:
        return [f"the demonstration's patch does not resolve the task ({outcome.grade})"]
    return []


def check_tasks(tasks: list[Instance], demos: dict[str, Demonstration] | None = None, jobs: int = 2) -> list[TaskCheck]:
    """`check_task` for each task, `jobs` at a time, in the order given."""
    demos = demos or {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda t: check_task(t, demos.get(t.instance_id)), tasks))
