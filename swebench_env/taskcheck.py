"""A task's tests, run where its patches are graded: `check` (is the task sound?) and `derive` (its test lists).

Both run the task's test files twice: with only its test patch applied ("before") and with its gold
patch too ("after"), through an `Evaluate` function: the Docker grader by default (the task's own
image or install recipe, the sandbox its rollouts are graded in), or `evaluate_locally` (this
machine's Python, no isolation: trusted tasks on a machine without Docker).

check: every FAIL_TO_PASS test fails before and every PASS_TO_PASS test passes; the gold patch resolves
the task; the gold patch touches only source files and the test patch only test files (the checks that
`suite/verify.py` runs locally on the shipped suite). A test module that cannot import a package says
which, and what to give the task.

derive: FAIL_TO_PASS is the tests that do not pass before (failed, errored, or absent) and pass after;
PASS_TO_PASS the tests that pass both times (SWE-bench's definitions; skipped ones are in neither); both
sorted. A test that passes before and not after is broken by the gold patch: an error for that task, as
is a gold patch that makes no test pass. With `runs` > 1 every run must agree on which tests pass, or the
tests that disagree are named as flaky. Everything else in a record is written back as it was read.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from core.errors import unknown_name
from swebench_env.environments import RecipeError
from swebench_env.evaluation import (
    DEFAULT_TEST_TIMEOUT_S,
    MAINTAINED,
    PASSING,
    Evaluation,
    evaluate_locally,
    status_of,
)
from swebench_env.git import GitError
from swebench_env.suite.verify import TaskCheck, _patch_shape
from swebench_env.tasks import Instance, TaskFormatError, parse_records, read_task_file, task_from_dict

Evaluate = Callable[[Instance, str], Evaluation]
SANDBOXES = ("docker", "local")
PLACEHOLDER = "derive-tests::placeholder"  # a FAIL_TO_PASS for the run: a Task needs one, the run ignores it
_NO_MODULE = re.compile(r"No module named '([^']+)'")


def evaluator(sandbox: str, image: str | None = None, timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> Evaluate:
    """(task, patch) -> Evaluation for a `--sandbox` choice; `image`: the default for tasks that name none."""
    if sandbox == "local":
        return functools.partial(_evaluate_here, timeout_s=timeout_s)
    if sandbox == "docker":
        from swebench_env.grading import DockerGrader, DockerGraderConfig

        return DockerGrader(DockerGraderConfig(image=image, test_timeout_s=timeout_s))
    raise unknown_name("sandbox", sandbox, SANDBOXES)


def _evaluate_here(task: Instance, patch: str, timeout_s: float) -> Evaluation:
    return evaluate_locally(task, patch, timeout_s)


def _unrunnable() -> tuple[type[Exception], ...]:
    """What makes a task's tests impossible to run (no verdict on the task's lists): per task, not fatal."""
    from swebench_env.grading import GradingError
    from swebench_env.images import ImageUnavailable

    return GradingError, RecipeError, ImageUnavailable, GitError


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


# ---- check ----


def check_task(task: Instance, evaluate: Evaluate) -> TaskCheck:
    """The checks of the module docstring, in `evaluate`'s sandbox; problems as text, never raised."""
    start = time.perf_counter()
    problems = _patch_shape(task)
    try:
        empty, gold = evaluate(task, ""), evaluate(task, task.patch)
    except _unrunnable() as e:
        problems.append(f"its tests cannot run: {_one_line(e)}")
        return TaskCheck(task.instance_id, tuple(problems), time.perf_counter() - start)
    still_pass = [t for t in task.FAIL_TO_PASS if status_of(t, empty.statuses) in PASSING]
    broken = [t for t in task.PASS_TO_PASS if status_of(t, empty.statuses) not in PASSING]
    if still_pass:
        problems.append(f"FAIL_TO_PASS tests pass without a fix: {still_pass}")
    if broken:
        problems.append(f"PASS_TO_PASS tests fail at the base commit: {broken}{_missing_module(empty)}")
    if empty.resolved:
        problems.append("the empty patch resolves the task")
    if not gold.resolved:
        problems.append(f"the gold patch does not resolve the task: {_why_unresolved(task, gold)}")
    return TaskCheck(task.instance_id, tuple(problems), time.perf_counter() - start)


def check_tasks(tasks: Sequence[Instance], evaluate: Evaluate, jobs: int = 2) -> list[TaskCheck]:
    """`check_task` for each task, `jobs` at a time, in the order given."""
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="check") as pool:
        return list(pool.map(lambda t: check_task(t, evaluate), tasks))


def _why_unresolved(task: Instance, gold: Evaluation) -> str:
    missing = _missing_module(gold)
    if missing:
        return missing.removeprefix("; ")
    if not gold.applied:
        return "it does not apply"
    if gold.problem:
        return gold.problem
    f2p = [t for t in task.FAIL_TO_PASS if status_of(t, gold.statuses) not in PASSING]
    p2p = [t for t in task.PASS_TO_PASS if status_of(t, gold.statuses) not in MAINTAINED]
    return f"FAIL_TO_PASS not passing: {f2p}; PASS_TO_PASS not passing: {p2p}"


def _missing_module(evaluation: Evaluation) -> str:
    found = _NO_MODULE.search(evaluation.log)
    if found is None:
        return ""
    return (
        f"; its tests cannot import {found.group(1)!r} (ModuleNotFoundError) in their sandbox: give the task "
        "an 'install' recipe or an 'image' that provides it"
    )


# ---- derive ----


@dataclass(frozen=True)
class Derived:
    instance_id: str
    FAIL_TO_PASS: tuple[str, ...] = ()
    PASS_TO_PASS: tuple[str, ...] = ()
    problem: str | None = None  # why the lists could not be derived; None: they were
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def lists(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self.FAIL_TO_PASS, self.PASS_TO_PASS


class _Unusable(Exception):
    """A run whose results cannot be used; the message says why."""


def derive_tests(task: Instance, evaluate: Evaluate, runs: int = 1) -> Derived:
    """FAIL_TO_PASS and PASS_TO_PASS of `task` (its own lists are not read), from `runs` runs before and after."""
    start = time.perf_counter()
    probe = replace(task, FAIL_TO_PASS=(PLACEHOLDER,), PASS_TO_PASS=())
    try:
        before = [_passing(probe, "", evaluate) for _ in range(runs)]
        after = [_passing(probe, task.patch, evaluate) for _ in range(runs)]
    except _Unusable as e:
        return Derived(task.instance_id, problem=str(e), seconds=time.perf_counter() - start)
    f2p, p2p = tuple(sorted(after[0] - before[0])), tuple(sorted(after[0] & before[0]))
    flaky = sorted(set().union(*before) - set.intersection(*before) | set().union(*after) - set.intersection(*after))
    broken = sorted(before[0] - after[0])
    problem = None
    if flaky:
        problem = f"flaky: these tests pass in some of {runs} runs and not in others: {flaky}"
    elif broken:
        problem = f"the gold patch breaks tests that pass without it: {broken}"
    elif not f2p:
        problem = "no test fails without the gold patch and passes with it"
    return Derived(task.instance_id, f2p, p2p, problem, time.perf_counter() - start)


def _passing(task: Instance, patch: str, evaluate: Evaluate) -> set[str]:
    when = "with the gold patch" if patch else "with only the test patch"
    try:
        evaluation = evaluate(task, patch)
    except _unrunnable() as e:
        raise _Unusable(f"its tests cannot run {when}: {_one_line(e)}") from e
    if not evaluation.applied:
        raise _Unusable("the gold patch does not apply at the base commit")
    usable = evaluation.problem is None or (not patch and "timed out" not in evaluation.problem)
    if not usable:  # before the fix, a run that lists nothing passing is a result; after it, it is not
        raise _Unusable(f"{when}, {evaluation.problem}{_missing_module(evaluation)}")
    return {t for t, s in evaluation.statuses.items() if s in PASSING}


@dataclass(frozen=True)
class DerivedFile:
    path: Path
    records: list[tuple[str, Any]]  # (place, record) as read
    results: dict[str, Derived]  # instance id (or place, for a record that does not load) -> result
    as_list: bool  # the file is a JSON list (else JSONL)

    def as_read(self, instance_id: str) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
        """The (FAIL_TO_PASS, PASS_TO_PASS) the file gives `instance_id`; None for one absent or unreadable."""
        records = (r for _, r in self.records if isinstance(r, Mapping) and r.get("instance_id") == instance_id)
        record = next(records, {})
        return listed(record, "FAIL_TO_PASS"), listed(record, "PASS_TO_PASS")


def derive_file(
    path: Path, evaluate: Evaluate, ids: Sequence[str] | None = None, runs: int = 1, jobs: int = 2
) -> DerivedFile:
    """`derive_tests` for the records of a task file (those of `ids` only, when given), `jobs` at a time."""
    if runs < 1 or jobs < 1:
        raise ValueError(f"--runs and --jobs must be >= 1, got {runs} and {jobs}")
    text = read_task_file(path)
    placed = parse_records(text, str(path))
    tasks: dict[str, Instance] = {}
    results: dict[str, Derived] = {}
    for place, record in placed:
        iid = record.get("instance_id") if isinstance(record, Mapping) else None
        if ids and iid not in ids:
            continue
        try:
            run_record = {**record, "FAIL_TO_PASS": [PLACEHOLDER], "PASS_TO_PASS": []}
            tasks[iid] = task_from_dict(run_record, path.parent.resolve())
        except TaskFormatError as e:
            results[str(iid or place)] = Derived(str(iid or place), problem=f"{place}: {e}")
    unknown = sorted(set(ids or ()) - set(tasks) - set(results))
    if unknown:
        raise ValueError(f"no task {unknown[0]!r} in {path}; it has {len(placed)} records")
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="derive") as pool:
        results |= dict(zip(tasks, pool.map(lambda t: derive_tests(t, evaluate, runs), tasks.values()), strict=True))
    return DerivedFile(path, placed, results, text.lstrip().startswith("["))


def listed(record: Any, key: str) -> tuple[str, ...] | None:
    """A record's FAIL_TO_PASS or PASS_TO_PASS as read (a list or a JSON-encoded list), None if unreadable."""
    value = record.get(key) if isinstance(record, Mapping) else None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return tuple(value) if isinstance(value, list) else None


def updated_records(derived: DerivedFile, out: Path) -> list[Any]:
    """The file's records with each derived task's lists replaced (in the encoding the record used: a list or a
    JSON string), everything else as read; a relative `repo_path` rewritten to mean the same from `out`'s folder."""
    here, there = derived.path.parent.resolve(), out.parent.resolve()
    records = []
    for _, record in derived.records:
        result = derived.results.get(record.get("instance_id")) if isinstance(record, Mapping) else None
        if result is not None and result.ok:
            record = dict(record)
            for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
                value = list(getattr(result, key))
                record[key] = json.dumps(value) if isinstance(record.get(key), str) else value
        repo_path = record.get("repo_path") if isinstance(record, Mapping) else None
        if here != there and isinstance(repo_path, str) and not Path(repo_path).is_absolute():
            record = {**record, "repo_path": os.path.relpath(here / repo_path, there)}
        records.append(record)
    return records


def write_records(records: list[Any], out: Path, as_list: bool) -> Path:
    """Write `records` as a JSON list (`as_list`) or JSONL, as `tasks.dump_tasks` does, replacing `out` at once."""
    if as_list:
        text = json.dumps(records, indent=1, ensure_ascii=False) + "\n"
    else:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=out.parent, suffix=".tmp", delete=False) as f:
        f.write(text)
    os.chmod(f.name, 0o644)  # a temporary file is private; a task file is not
    os.replace(f.name, out)
    return out
