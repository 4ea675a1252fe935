"""Tasks in SWE-bench's instance schema: load, validate, write, and check out a task's repository.

A task file is a JSON list of instances or JSONL (one instance a line), as SWE-bench and SWE-smith
publish them. Official files store `FAIL_TO_PASS` and `PASS_TO_PASS` as JSON-encoded strings
(`"[\\"tests/test_x.py::test_y\\"]"`); plain lists are accepted too, and `dump_tasks` writes lists.

One field goes beyond SWE-bench's schema: `repo_path`, where the repository comes from when it is not
GitHub's `repo`: a local git directory (work tree or bare) or a git bundle file, relative to the task
file. With it, tasks are added offline; without it, `repo` is GitHub's `owner/name` and official
instances load unchanged. Fields a file carries beyond the schema (e.g. SWE-bench Verified's
`difficulty`) are kept in `Instance.extra` and written back; a misspelling of a known field is an error.
Two of them are read: `image` and `install`, the task's environment (`environments.py`), checked when
the task is made and read through `Instance.environment`.

`materialize_repo` fetches only `base_commit` and its history into a fresh repository on branch
`main`, so commits after the base commit (the fix, for a real issue) are not in the checkout.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from swebench_env.environments import FIELDS as ENVIRONMENT_FIELDS
from swebench_env.environments import RecipeError, TaskEnvironment, environment_of
from swebench_env.git import DEFAULT_TIMEOUT_S, git, is_repository

GITHUB_URL = "https://github.com/{repo}.git"
INSTANCE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
GITHUB_REPO = re.compile(r"[A-Za-z0-9_.\-]+/[A-Za-z0-9_.\-]+")
COMMIT = re.compile(r"[0-9a-f]{40}")
REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "patch",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)

STRING_FIELDS = (*REQUIRED[:6], "version", "environment_setup_commit", "hints_text", "created_at")


class TaskFormatError(ValueError):
    """A task file or record breaks the schema; the message names the place, the field and what is allowed."""


@dataclass(frozen=True)
class Instance:
    """One SWE-bench instance. Test ids are pytest node ids, e.g. `tests/test_x.py::test_y[1-2]`."""

    instance_id: str  # unique in a file; letters, digits, `_.-` (used in file and container names)
    repo: str  # GitHub `owner/name`; with `repo_path`, any label
    base_commit: str  # 40 hex digits: the state the agent starts from
    problem_statement: str  # the issue text the agent sees
    patch: str  # the gold fix (a unified diff of source files)
    test_patch: str  # the tests that check the fix (a unified diff of test files), withheld from the agent
    FAIL_TO_PASS: tuple[str, ...]  # tests that fail at the base commit and must pass after the fix
    PASS_TO_PASS: tuple[str, ...]  # tests that pass before and must still pass after
    version: str = ""  # the repository's version, as SWE-bench groups environments ("3.0")
    environment_setup_commit: str = ""  # commit whose dependencies the environment installs; "" = base_commit
    hints_text: str = ""  # issue comments made before the fix
    created_at: str = ""  # ISO 8601 time the issue or fix was made
    repo_path: Path | None = None  # local git directory or bundle; None: clone GitHub's `repo`
    extra: dict[str, Any] = field(default_factory=dict, hash=False)  # fields beyond the schema, kept as read

    def __post_init__(self) -> None:
        for name in STRING_FIELDS:
            _expect_str(self, name)
        if not INSTANCE_ID.fullmatch(self.instance_id):
            raise TaskFormatError(f"instance {self.instance_id!r}: field 'instance_id': use letters, digits and _.-")
        if self.repo_path is None and not GITHUB_REPO.fullmatch(self.repo):
            raise _bad(self, "repo", f"expected GitHub's 'owner/name' (or give 'repo_path'), got {self.repo!r}")
        for name in ("base_commit", "environment_setup_commit"):
            value = getattr(self, name)
            if value and not COMMIT.fullmatch(value):
                raise _bad(self, name, f"expected a full 40-hex-digit commit id, got {value!r}")
        if not self.environment_setup_commit:
            object.__setattr__(self, "environment_setup_commit", self.base_commit)
        for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(t, str) and t for t in value):
                raise _bad(self, name, f"expected a tuple of non-empty test id strings, got {value!r}")
        if not self.FAIL_TO_PASS:
            raise _bad(self, "FAIL_TO_PASS", "expected at least one test that the fix makes pass, got none")
        if self.repo_path is not None and not isinstance(self.repo_path, Path):
            raise _bad(self, "repo_path", f"expected a pathlib.Path or None, got {self.repo_path!r}")
        try:
            environment_of(self.extra)
        except RecipeError as e:
            raise TaskFormatError(f"instance {self.instance_id!r}: {e}") from None

    @property
    def environment(self) -> TaskEnvironment:
        """The image and install recipe the record names (its `image` and `install` fields), if any."""
        return environment_of(self.extra)

    def to_dict(self, relative_to: Path | None = None) -> dict[str, Any]:
        """The JSON record; `repo_path` relative to `relative_to` (a task file's folder) where it lies below it."""
        record: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        record["FAIL_TO_PASS"] = list(self.FAIL_TO_PASS)
        record["PASS_TO_PASS"] = list(self.PASS_TO_PASS)
        if self.repo_path is None:
            del record["repo_path"]
        else:
            record["repo_path"] = _relative(self.repo_path, relative_to)
        return {**record, **self.extra}


def _expect_str(task: Instance, name: str) -> None:
    value = getattr(task, name)
    if not isinstance(value, str):
        raise _bad(task, name, f"expected a string, got {type(value).__name__} {value!r:.60}")


def _bad(task: Instance, name: str, what: str) -> TaskFormatError:
    return TaskFormatError(f"instance {getattr(task, 'instance_id', '?')!r}: field {name!r}: {what}")


def _relative(path: Path, base: Path | None) -> str:
    if base is not None and path.is_relative_to(base.resolve()):
        return path.relative_to(base.resolve()).as_posix()
    return str(path)


def task_from_dict(record: Mapping[str, Any], base_dir: Path | None = None) -> Instance:
    """A Task from one JSON record; a relative `repo_path` is taken from `base_dir` (default: the cwd)."""
    if not isinstance(record, Mapping):
        raise TaskFormatError(f"expected a JSON object per task, got {type(record).__name__}")
    name = record.get("instance_id", "?")
    known = {f.name for f in fields(Instance)} - {"extra"}
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise TaskFormatError(f"instance {name!r}: missing field(s) {missing}; a task needs {list(REQUIRED)}")
    for key in record:
        close = difflib.get_close_matches(key, [*known, *ENVIRONMENT_FIELDS], n=1, cutoff=0.8)
        if key not in known and key not in ENVIRONMENT_FIELDS and close:
            raise TaskFormatError(f"instance {name!r}: unknown field {key!r} (did you mean {close[0]!r}?)")
    values = {k: v for k, v in record.items() if k in known}
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        values[key] = _test_ids(name, key, values[key])
    for key in ("version", "environment_setup_commit", "hints_text", "created_at"):
        if values.get(key) is None:
            values.pop(key, None)  # SWE-bench files sometimes carry null for "unknown"
    if values.get("repo_path") is not None:
        values["repo_path"] = _repo_path(name, values["repo_path"], base_dir or Path.cwd())
    extra = {k: v for k, v in record.items() if k not in known}
    return Instance(**values, extra=extra)


def _test_ids(name: str, key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise TaskFormatError(
                f"instance {name!r}: field {key!r}: a string must be a JSON-encoded list of test ids, got {value!r:.80}"
            ) from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise TaskFormatError(
            f"instance {name!r}: field {key!r}: expected a list of test id strings "
            f"(or a JSON-encoded list string), got {value!r:.80}"
        )
    return tuple(value)


def _repo_path(name: str, value: Any, base_dir: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise TaskFormatError(f"instance {name!r}: field 'repo_path': expected a path string, got {value!r}")
    path = (base_dir / value).resolve()
    if not path.exists():
        raise TaskFormatError(
            f"instance {name!r}: field 'repo_path': {value!r} does not exist (looked for {path}); "
            "give a git directory or a git bundle file, relative to the task file"
        )
    if path.is_dir() and not is_repository(path):
        raise TaskFormatError(f"instance {name!r}: field 'repo_path': {path} is a folder but not a git repository")
    return path


def parse_tasks(
    text: str, source: str = "<tasks>", base_dir: Path | None = None, problems: list[str] | None = None
) -> list[Instance]:
    """Tasks from the text of a JSON list (or one object) or of JSONL; `source` names the text in errors.
    With a `problems` list, a record that breaks the schema (or a JSONL line that is not JSON) is skipped
    and a line saying why is appended to it; without, the first one raises TaskFormatError."""
    placed = parse_records(text, source, problems)
    return _validated([r for _, r in placed], [p for p, _ in placed], base_dir, problems)


def parse_records(text: str, source: str = "<tasks>", problems: list[str] | None = None) -> list[tuple[str, Any]]:
    """(place, JSON record) for each record of a JSON list or JSONL text, unvalidated; a place reads
    "<source> line 3" or "<source> item 2". A JSONL line that is not JSON: as for `parse_tasks`."""
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskFormatError(f"{source}: not valid JSON: {e}") from None
        return [(f"{source} item {i}", r) for i, r in enumerate(records)]
    placed = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            placed.append((f"{source} line {number}", json.loads(line)))
        except json.JSONDecodeError as e:
            _problem(TaskFormatError(f"{source} line {number}: not valid JSON: {e}"), problems)
    return placed


def _problem(error: TaskFormatError, problems: list[str] | None) -> None:
    if problems is None:
        raise error
    problems.append(str(error))


def _validated(
    records: list[Any], places: list[str], base_dir: Path | None, problems: list[str] | None
) -> list[Instance]:
    tasks: list[Instance] = []
    seen: dict[str, str] = {}
    for record, place in zip(records, places, strict=True):
        try:
            task = task_from_dict(record, base_dir)
        except TaskFormatError as e:
            _problem(TaskFormatError(f"{place}: {e}"), problems)
            continue
        if task.instance_id in seen:
            first = seen[task.instance_id]
            duplicate = TaskFormatError(f"{place}: duplicate instance_id {task.instance_id!r} (first at {first})")
            _problem(duplicate, problems)
            continue
        seen[task.instance_id] = place
        tasks.append(task)
    return tasks


def load_tasks(path: Path | str, problems: list[str] | None = None) -> list[Instance]:
    """Every task in a JSON or JSONL file; relative `repo_path`s are taken from the file's folder. `problems`:
    as for `parse_tasks` (skip bad records, say why there)."""
    path = Path(path)
    return parse_tasks(read_task_file(path), source=str(path), base_dir=path.parent.resolve(), problems=problems)


def read_task_file(path: Path) -> str:
    """The text of a task file; FileNotFoundError or TaskFormatError (one line) when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"task file {path} does not exist") from None
    except OSError as e:  # a folder, no permission
        raise TaskFormatError(f"task file {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise TaskFormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def dump_tasks(tasks: Iterable[Instance], path: Path | str) -> Path:
    """Write `tasks` as JSONL (JSON list if `path` ends in `.json`), `repo_path` relative to the file's folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [t.to_dict(relative_to=path.parent) for t in tasks]
    if path.suffix == ".json":
        text = json.dumps(records, indent=1, ensure_ascii=False) + "\n"
    else:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    path.write_text(text, encoding="utf-8")
    return path


def materialize_repo(
    task: Instance,
    dest: Path | str,
    *,
    github_url: str = GITHUB_URL,
    depth: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Path:
    """Check out `task`'s repository at `base_commit` into `dest` (absent or empty), on branch `main`.

    Fetches from `task.repo_path` (a git directory or bundle) or else from `github_url` formatted with
    `repo`. Only `base_commit` and its ancestors are fetched (the last `depth` commits of them, if
    given); no remote is left configured. Raises GitError (with git's message) when the source lacks
    the commit or cannot be read.
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"cannot check out {task.instance_id!r} into {dest}: the folder is not empty")
    source = str(task.repo_path) if task.repo_path is not None else github_url.format(repo=task.repo)
    dest.mkdir(parents=True, exist_ok=True)
    git("init", "-q", "-b", "main", cwd=dest)
    shallow = [f"--depth={depth}"] if depth is not None else []
    git("fetch", "-q", "--no-tags", *shallow, source, task.base_commit, cwd=dest, timeout_s=timeout_s)
    git("checkout", "-q", "-B", "main", task.base_commit, cwd=dest)
    return dest


def is_official(task: Instance) -> bool:
    """A SWE-bench dataset record that carries its own evaluation script (and no local repository)."""
    return task.repo_path is None and isinstance(task.extra.get("eval_script"), str)
