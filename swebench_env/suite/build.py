"""Build the offline suite: one task per (library, bug), each a git bundle plus its SWE-bench record.

For one bug the generator, in a temporary folder:
1. writes the library with the bug injected and runs its whole test file: the failing tests are
   FAIL_TO_PASS, the passing ones PASS_TO_PASS (as SWE-bench's harness classifies them, with the
   test patch applied at the base commit);
2. withholds the test functions that fail from the test file and commits that state once, with a
   fixed author, committer and date, so the commit id is the same on every run: `base_commit`;
3. takes `test_patch` (the withheld tests back) and `patch` (the gold fix) as `git diff`s against it;
4. runs the issue's `repro` script at the buggy and at the fixed state, and writes the problem
   statement from the bug's title and story and the two outputs (the symptom, never the fix);
5. writes the repository as a bundle holding just that commit (no history, so nothing leaks the
   fix) and a demonstration (`demonstrate.py`).

Whole libraries form the held-out split (`HELD_OUT_LIBRARIES`), so held-out tasks are code that
training never saw, as SWE-Gym keeps its repositories apart from SWE-bench's.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from swebench_env.demos import Demonstration, dump_demonstrations
from swebench_env.evaluation import PASSING, Outcome, run_pytest
from swebench_env.git import deterministic_env, git
from swebench_env.suite.demonstrate import make_demonstration
from swebench_env.suite.library import Bug, Library, load_libraries
from swebench_env.suite.mutations import Module
from swebench_env.tasks import Instance, dump_tasks

ID_PREFIX = "swesuite"
HELD_OUT_LIBRARIES = ("semver", "statskit")
SPLITS = ("train", "held_out")
COMMIT_DATE = "2024-03-01T12:00:00+00:00"
CREATED_AT = "2024-03-01T12:00:00Z"
REPRO_TIMEOUT_S = 30.0
GITIGNORE = "__pycache__/\n*.py[cod]\n.pytest_cache/\n*.egg-info/\n"
PYPROJECT = """[project]
name = "{name}"
version = "{version}"
description = "{description}"
requires-python = ">=3.9"

[tool.pytest.ini_options]
testpaths = ["tests"]
pythonpath = ["."]
"""


class SuiteBuildError(RuntimeError):
    """A bug does not make a valid task (breaks no test, breaks every test, or its repro shows nothing)."""


@dataclass(frozen=True)
class BuiltTask:
    task: Instance
    demonstration: Demonstration
    split: str


def instance_id(library: str, number: int) -> str:
    return f"{ID_PREFIX}__{library}-{number}"


def split_of(library: str) -> str:
    return "held_out" if library in HELD_OUT_LIBRARIES else "train"


def repository_files(lib: Library) -> dict[str, str]:
    """Every file of the library's repository in its correct state, including the generated boilerplate."""
    files = dict(lib.files)
    files["pyproject.toml"] = PYPROJECT.format(name=lib.name, version=lib.version, description=lib.description)
    files[".gitignore"] = GITIGNORE
    return files


def build_task(lib: Library, number: int, repos_dir: Path) -> BuiltTask:
    """Build task `number` (1-based) of `lib`, writing its bundle into `repos_dir`."""
    bug = lib.bugs[number - 1]
    iid = instance_id(lib.name, number)
    correct = repository_files(lib)
    buggy = {**correct, bug.file: bug.edit(correct[bug.file]).apply(correct[bug.file])}
    with tempfile.TemporaryDirectory(prefix=f"{iid}-") as tmp:
        repo = Path(tmp) / "repo"
        _write(repo, buggy)
        fail, passing = _classify(iid, repo, [p for p in correct if _is_test_file(p)])
        observed = _run_repro(repo, bug.repro)
        _write(repo, {bug.file: correct[bug.file]})
        expected = _run_repro(repo, bug.repro)
        if expected.startswith("fails with"):
            raise SuiteBuildError(f"{iid}: the repro fails on the fixed code too: {expected}")
        if observed == expected:
            raise SuiteBuildError(f"{iid}: the repro prints the same before and after the fix: {observed!r}")
        base = {**buggy, **_withhold(correct, fail)}
        base_commit = _commit(repo, base, f"{lib.name} {lib.version}")
        test_patch = _diff(repo, {p: correct[p] for p in base if _is_test_file(p)})
        patch = _diff(repo, {bug.file: correct[bug.file]})
        bundle = repos_dir / f"{iid}.bundle"
        bundle.parent.mkdir(parents=True, exist_ok=True)
        git("-c", "pack.threads=1", "bundle", "create", "-q", str(bundle.resolve()), "HEAD", "main", cwd=repo)
    task = Instance(
        instance_id=iid,
        repo=f"{ID_PREFIX}/{lib.name}",
        base_commit=base_commit,
        problem_statement=problem_statement(bug, observed, expected),
        patch=patch,
        test_patch=test_patch,
        FAIL_TO_PASS=tuple(fail),
        PASS_TO_PASS=tuple(passing),
        version=lib.version,
        created_at=CREATED_AT,
        repo_path=bundle.resolve(),
        extra={"bug_operator": bug.operator},
    )
    demo = make_demonstration(iid, bug, buggy[bug.file], correct[bug.file])
    return BuiltTask(task, demo, split_of(lib.name))


def _is_test_file(path: str) -> bool:
    return path.startswith("tests/") and path.endswith(".py")


def _write(repo: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


def _classify(iid: str, repo: Path, test_files: list[str]) -> tuple[list[str], list[str]]:
    """(failing, passing) test ids of the buggy state with every test present."""
    statuses, log = run_pytest(repo, test_files)
    errors = [t for t, s in statuses.items() if s is Outcome.ERROR]
    if not statuses or errors:
        raise SuiteBuildError(f"{iid}: the tests did not run cleanly (errors: {errors}):\n{log[-2000:]}")
    fail = sorted(t for t, s in statuses.items() if s not in PASSING)
    passing = sorted(t for t, s in statuses.items() if s in PASSING)
    if not fail or not passing:
        raise SuiteBuildError(
            f"{iid}: the bug must break some tests and keep others: {len(fail)} fail, {len(passing)} pass"
        )
    return fail, passing


def _withhold(files: dict[str, str], test_ids: list[str]) -> dict[str, str]:
    """The test files with the test functions of `test_ids` removed (with the blank lines before them)."""
    names: dict[str, set[str]] = {}
    for test_id in test_ids:
        path, _, name = test_id.partition("::")
        if "::" in name:
            raise SuiteBuildError(f"only top-level test functions can be withheld, got {test_id}")
        names.setdefault(path, set()).add(name.split("[")[0])
    return {path: _without_functions(files[path], wanted) for path, wanted in names.items()}


def _without_functions(source: str, names: set[str]) -> str:
    lines = source.splitlines(keepends=True)
    drop: set[int] = set()
    for node in Module(source).tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            while start > 0 and not lines[start - 1].strip():
                start -= 1
            drop.update(range(start, node.end_lineno))
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def _run_repro(repo: Path, script: str) -> str:
    """What `script` prints, or "fails with <the exception line>" when it raises."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=REPRO_TIMEOUT_S,
        env={"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"},
    )
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        return f"fails with {last}"
    return done.stdout.rstrip("\n")


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    env = deterministic_env(COMMIT_DATE)
    _write(repo, files)
    git("init", "-q", "-b", "main", cwd=repo, env=env)
    git("add", "-A", cwd=repo, env=env)
    git("commit", "-q", "--no-verify", "-m", message, cwd=repo, env=env)
    return git("rev-parse", "HEAD", cwd=repo, env=env).strip()


def _diff(repo: Path, files: dict[str, str]) -> str:
    """The `git diff` that writing `files` makes to the committed state (which is then restored)."""
    _write(repo, files)
    patch = git("diff", "--no-color", "--no-ext-diff", cwd=repo)
    git("checkout", "-q", "--", ".", cwd=repo)
    return patch


def problem_statement(bug: Bug, observed: str, expected: str) -> str:
    """The issue text: title, story, the repro script, what it does and what the user expected."""
    got = f"{observed.removeprefix('fails with ')}" if observed.startswith("fails with") else observed
    says = "fails with" if observed.startswith("fails with") else "prints"
    return (
        f"{bug.title}\n\n{bug.story}\n\n```python\n{bug.repro.rstrip()}\n```\n\n"
        f"{says}\n\n```\n{got}\n```\n\nbut I expected\n\n```\n{expected}\n```\n"
    )


def build_tasks(libraries: list[Library], repos_dir: Path, jobs: int = 2) -> list[BuiltTask]:
    """Every task of `libraries`, built `jobs` at a time, in (library, bug number) order."""
    work = [(lib, n) for lib in libraries for n in range(1, len(lib.bugs) + 1)]

    def attempt(item: tuple[Library, int]) -> BuiltTask | str:
        try:
            return build_task(*item, repos_dir)
        except SuiteBuildError as e:
            return str(e)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(attempt, work))
    failures = [r for r in results if isinstance(r, str)]
    if failures:
        raise SuiteBuildError(f"{len(failures)} of {len(work)} tasks could not be built:\n" + "\n".join(failures))
    return results


def write_suite(built: list[BuiltTask], out: Path) -> None:
    """The task and demonstration files of each split, beside the bundles in `out/repos`."""
    for split in SPLITS:
        chosen = [b for b in built if b.split == split]
        dump_tasks([b.task for b in chosen], out / f"{split}.jsonl")
        dump_demonstrations([b.demonstration for b in chosen], out / "demonstrations" / f"{split}.jsonl")


def generate_suite(out: Path, jobs: int = 2, libraries: list[Library] | None = None) -> list[BuiltTask]:
    """(Re)generate the whole suite into `out`, replacing a suite already there; returns what it built."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "train.jsonl").exists():
        raise FileExistsError(f"{out} is neither empty nor a suite folder; refusing to write into it")
    for stale in ("repos", "demonstrations"):
        shutil.rmtree(out / stale, ignore_errors=True)
    built = build_tasks(libraries if libraries is not None else load_libraries(), out / "repos", jobs)
    write_suite(built, out)
    (out / "manifest.json").write_text(json.dumps(_manifest(built), indent=1) + "\n", encoding="utf-8")
    return built


def _manifest(built: list[BuiltTask]) -> dict:
    return {
        "splits": {s: [b.task.instance_id for b in built if b.split == s] for s in SPLITS},
        "held_out_libraries": list(HELD_OUT_LIBRARIES),
    }
