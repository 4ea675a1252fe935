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

Protected files (`protected_paths`, the one rule both graders apply). SWE-bench resets only the test
files of the test patch, so a patch that adds a root `conftest.py` forcing every test to pass resolves
any task there. Here a candidate's change to any file that configures the test run or the interpreter's
start-up, or that looks like a test, is undone before the tests run: the file is put back as it was
before the patch (deleted if the patch added it). The rest of the patch is graded as usual, so a fix
that also adds its own tests or touches `setup.cfg` is not punished, only its protected part dropped
(a legitimate change to `pyproject.toml` or `setup.cfg` is dropped too; SWE-bench's gold patches keep
test files out, and its environments are installed before the patch, so that rarely matters). Protected:
- test configuration: `conftest.py`, `pytest.ini`, `.pytest.ini`, `pytest.toml`, `.pytest.toml`,
  `tox.ini`, `setup.cfg`, `pyproject.toml` (the whole file: its pytest section can add `-p plugin`,
  `--deselect` or `-k`), anywhere in the tree;
- interpreter start-up: `sitecustomize.py`, `usercustomize.py`, `*.pth`, and compiled code
  (`*.pyc`, `*.pyo`, anything under `__pycache__/`), anywhere;
- tests: the files the test patch touches, `test_*.py`, `*_test.py`, `tests.py`, anything under a
  `tests/` or `test/` folder;
- a top-level module that shadows one pytest or the standard library imports (`pytest.py`, `json.py`,
  `_pytest/__init__.py`...: `python -m pytest` puts the repository first on `sys.path`), and `.git/`.
Not caught: source code that the tests import and that patches pytest or the tests at import time
(`_pytest.python.Function.runtest = ...` in the package under test), a plugin module that the base
commit's own configuration loads and the patch edits, and anything the tests themselves run (a
subprocess that rewrites a test file). The tests also run with pytest's plugin auto-loading off, no
cache plugin, no bytecode written, and `PYTEST_ADDOPTS` / `PYTEST_PLUGINS` unset.

The pure parts (`judged_files`, `protected_paths`, `pytest_command`, `parse_pytest_log`, `grade`,
`read_eval_log`) are what the Docker grader (`grading.py`) uses. `evaluate_locally` is the plain-subprocess version the
suite generator uses; it runs the repository's code on this machine, so use it only on trusted tasks
(the shipped suite, your own).

Only pytest repositories are handled: official SWE-bench repositories such as django or sympy need
their own test command and log parser per repository, which a grader adds beside `pytest_command`.
"""

from __future__ import annotations

import enum
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from swebench_env.git import GitError, git
from swebench_env.tasks import Instance, materialize_repo

DEFAULT_TEST_TIMEOUT_S = 300.0
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_PYTEST_ARGS = ("-m", "pytest", "-rA", "-p", "no:cacheprovider", "--no-header", "-q")
_PYTEST_ENV_CLEARED = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")  # options and plugins from outside the repository
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
class Verdict:
    resolved: bool  # every FAIL_TO_PASS and PASS_TO_PASS test passed: the reward is 1
    fail_to_pass: tuple[int, int]  # (passed, total)
    pass_to_pass: tuple[int, int]  # (passed, total)


@dataclass(frozen=True)
class Evaluation:
    instance_id: str
    applied: bool  # the candidate patch applied cleanly (if not, nothing ran and `resolved` is False)
    statuses: Mapping[str, Outcome]  # test id -> status, from the log
    grade: Verdict
    log: str  # git apply's complaint, or pytest's output (in Docker: the whole graded run's log)
    problem: str | None = None  # why the log's test results were not trusted (see `read_eval_log`)
    undone: tuple[str, ...] = ()  # protected paths the patch touched, put back before the tests ran

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


def judged_files(task: Instance) -> list[str]:
    """The test files that judge `task`: those its test patch touches."""
    return patch_files(task.test_patch)


# The protected-file rule (see the module docstring): names anywhere in the tree, suffixes, folders.
CONFIG_NAMES = frozenset(
    {"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg"}
    | {"pyproject.toml", "sitecustomize.py", "usercustomize.py", "tests.py"}
)
PROTECTED_SUFFIXES = (".pth", ".pyc", ".pyo")
PROTECTED_DIRS = frozenset({"tests", "test", "__pycache__", ".git"})
TEST_FILE = re.compile(r"(test_.*|.*_test)\.py")
# Modules `python -m pytest` imports that a top-level file of the repository would shadow.
SHADOWED = sys.stdlib_module_names | {
    "pytest",
    "_pytest",
    "py",
    "pluggy",
    "iniconfig",
    "packaging",
    "exceptiongroup",
    "tomli",
    "pygments",
    "attr",
    "xdist",
}
_IMPORTABLE = (".py", ".pyc", ".pyo", ".pyw", ".so", ".pyd")
_PATCH_PATH = re.compile(r"^(?:diff --git |--- |\+\+\+ |\*\*\* |Index: |(?:rename|copy) (?:from|to) )(.+)$", re.M)


def is_protected(path: str, judged: frozenset[str] = frozenset()) -> bool:
    """Whether a candidate patch may not change `path` (a repository-relative path): the rule above."""
    parts = path.split("/")
    name = parts[-1]
    return (
        path in judged
        or bool(PROTECTED_DIRS.intersection(parts))
        or name in CONFIG_NAMES
        or name.endswith(PROTECTED_SUFFIXES)
        or TEST_FILE.fullmatch(name) is not None
        or _shadows(parts)
    )


def _shadows(parts: list[str]) -> bool:
    """A top-level module (`json.py`, `pytest/__init__.py`) named as one that the test run imports."""
    if len(parts) == 2 and parts[1].split(".", 1)[0] in ("__init__", "__main__") and parts[1].endswith(_IMPORTABLE):
        return parts[0] in SHADOWED
    return len(parts) == 1 and parts[0].endswith(_IMPORTABLE) and parts[0].split(".", 1)[0] in SHADOWED


def touched_paths(patch: str, unstripped: bool = True) -> list[str]:
    """The repository paths a patch's headers name, read as `git apply` and `patch -p1` read them (quoted names
    unquoted, timestamps dropped, the first component stripped) and, with `unstripped`, also as written. It may
    name more than the patch changes (a removed line `-- x` reads as a header): harmless where the caller only
    puts paths back as they were. Absolute paths and paths through `..` are left out: both tools refuse them."""
    found: list[str] = []
    for field in _PATCH_PATH.findall(patch):
        for raw in _header_names(field):
            if raw == "/dev/null":
                continue
            for path in (raw.split("/", 1)[-1], raw) if unstripped else (raw.split("/", 1)[-1],):
                parts = path.split("/")
                if path and not path.startswith("/") and ".." not in parts:
                    found.append(path)
    return list(dict.fromkeys(found))


def _header_names(field: str) -> list[str]:
    """The file names in a header line's tail: `a/x b/x` (git), `"a/q x" "b/q x"` (quoted), `x<TAB>date`."""
    if field.startswith('"'):
        return [_unquote(m) for m in re.findall(r'"((?:[^"\\]|\\.)*)"', field)]
    field = field.split("\t", 1)[0].rstrip()
    half = (len(field) - 1) // 2  # `a/X b/X`: the same name twice, a space between
    if field[half : half + 1] == " " and field[:half].split("/", 1)[-1] == field[half + 1 :].split("/", 1)[-1]:
        return [field[:half], field[half + 1 :]]
    return [field, *field.split(" ")]


def _unquote(quoted: str) -> str:
    """Git's C-style quoting (`\\t`, `\\"`, octal bytes of UTF-8) undone."""
    return (
        quoted.encode("latin-1", "backslashreplace")
        .decode("unicode_escape")
        .encode("latin-1")
        .decode("utf-8", "replace")
    )


def protected_paths(task: Instance, patch: str, unstripped: bool = True) -> list[str]:
    """The paths `patch` may touch that the grader puts back as they were before it (sorted); without
    `unstripped`, only as the appliers read the headers (what the evaluation reports as undone)."""
    judged = frozenset(judged_files(task))
    return sorted(p for p in touched_paths(patch, unstripped) if is_protected(p, judged))


def pytest_command(task: Instance, python: str = "python") -> list[str]:
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


def grade(task: Instance, statuses: Mapping[str, Outcome]) -> Verdict:
    """SWE-bench's rule: resolved when every FAIL_TO_PASS test passed and every PASS_TO_PASS test passed or
    was skipped."""
    f2p = len(passed(task.FAIL_TO_PASS, statuses, PASSING))
    p2p = len(passed(task.PASS_TO_PASS, statuses, MAINTAINED))
    resolved = f2p == len(task.FAIL_TO_PASS) and p2p == len(task.PASS_TO_PASS)
    return Verdict(resolved, (f2p, len(task.FAIL_TO_PASS)), (p2p, len(task.PASS_TO_PASS)))


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
    """Run pytest with this Python on `paths` in `repo`: (test id -> outcome, log). A run past `timeout_s` is
    killed and its log ends with SWE-bench's `Tests Timed Out` marker (`read_eval_log` trusts none of it)."""
    env = {k: v for k, v in os.environ.items() if k not in _PYTEST_ENV_CLEARED}
    env |= {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, *_PYTEST_ARGS, *paths]
    try:
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {}, out + f"\n[tests killed after {timeout_s:g} s]\n{TESTS_TIMEOUT}\n"
    log = done.stdout + done.stderr
    return parse_pytest_log(log), log


def run_tests(task: Instance, repo: Path, timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> tuple[dict[str, Outcome], str]:
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


def undo_protected(task: Instance, repo: Path, patch: str) -> list[str]:
    """Put the protected paths `patch` touched back at the base commit in the checkout `repo` (remove those the
    base commit lacks); the paths, for the record."""
    paths = protected_paths(task, patch)
    at_base = [p for p in paths if _exists_at(repo, task.base_commit, p)]
    for path in set(paths) - set(at_base):
        target = repo / path
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    if at_base:
        git("checkout", "-q", task.base_commit, "--", *at_base, cwd=repo)
    return paths


def evaluate_in(task: Instance, repo: Path, patch: str, timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> Evaluation:
    """Apply `patch` to the fresh checkout `repo` of `task`, undo its protected part, run the tests, grade."""
    problem = apply_patch(repo, patch)
    if problem is not None:
        return Evaluation(task.instance_id, False, {}, grade(task, {}), problem)
    undo_protected(task, repo, patch)
    undone = tuple(protected_paths(task, patch, unstripped=False))
    statuses, log = run_tests(task, repo, timeout_s)
    why = _UNTRUSTED[TESTS_TIMEOUT] if TESTS_TIMEOUT in log else None
    return Evaluation(task.instance_id, True, statuses, grade(task, statuses), log, why, undone)


def evaluate_locally(task: Instance, patch: str, timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> Evaluation:
    """Check out `task` in a temporary folder, apply `patch`, run the tests with this Python, grade."""
    with tempfile.TemporaryDirectory(prefix=f"swe-{task.instance_id}-") as tmp:
        repo = materialize_repo(task, Path(tmp) / "repo")
        return evaluate_in(task, repo, patch, timeout_s)
