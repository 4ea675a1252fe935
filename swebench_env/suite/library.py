"""The suite's source libraries and the bugs to inject into them, read from `libs/<name>/`.

A library folder holds the files of a small pure-Python project as its repository will contain
them (sources, `tests/test_*.py`, `README.md`) and a `bugs.yaml`: its version, a one-line
description, and a list of bugs. A bug names the file, the function (`where`, a qualified name or
`<module>`), the operator from `mutations.OPERATORS` with its `params`, the `match` text (and
`occurrence`) that picks the site, and the words of the issue: `title`, `story`, a `repro` script
that prints the symptom, and an `explanation` of the fix (the reasoning in the demonstration).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from swebench_env.suite.mutations import Edit, MutationError, make_operator, mutate

LIBS_DIR = Path(__file__).parent / "libs"
BUG_FIELDS = {"file", "where", "operator", "params", "match", "occurrence", "title", "story", "repro", "explanation"}
BUG_TEXT_FIELDS = ("file", "where", "operator", "title", "story", "repro", "explanation")


@dataclass(frozen=True)
class Bug:
    file: str  # path in the repository, e.g. "rpncalc/evaluate.py"
    where: str  # qualified function name, or "<module>"
    operator: str  # a name in mutations.OPERATORS
    params: tuple[tuple[str, Any], ...]
    match: str
    occurrence: int | None
    title: str  # the title
    story: str  # the prose: what the user did and saw
    repro: str  # Python that prints the symptom; its output at the buggy and fixed states goes in the issue
    explanation: str  # why the code is wrong: the demonstration's reasoning before the edit

    def edit(self, source: str) -> Edit:
        """The edit that injects this bug into `source` (the correct file)."""
        return mutate(
            source, self.where, make_operator(self.operator, **dict(self.params)), self.match, self.occurrence
        )


@dataclass(frozen=True)
class Library:
    name: str
    version: str
    description: str
    files: tuple[tuple[str, str], ...]  # (path, text) of every repository file, sorted by path
    bugs: tuple[Bug, ...]

    def file(self, path: str) -> str:
        return dict(self.files)[path]


def load_library(folder: Path) -> Library:
    """The library in `folder`, its bugs checked against its sources (each must apply)."""
    spec_path = folder / "bugs.yaml"
    spec = yaml.safe_load(spec_path.read_text(encoding="utf-8"))
    if not isinstance(spec, dict) or not isinstance(spec.get("bugs"), list):
        raise ValueError(f"{spec_path}: expected a mapping with a 'bugs' list")
    files = tuple(
        (p.relative_to(folder).as_posix(), p.read_text(encoding="utf-8"))
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "bugs.yaml" and "__pycache__" not in p.parts
    )
    bugs = tuple(_bug(spec_path, i, record, dict(files)) for i, record in enumerate(spec["bugs"], start=1))
    return Library(folder.name, str(spec["version"]), str(spec["description"]), files, bugs)


def _bug(spec_path: Path, number: int, record: Any, files: dict[str, str]) -> Bug:
    where = f"{spec_path} bug {number}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a mapping, got {record!r:.60}")
    unknown = set(record) - BUG_FIELDS
    missing = [k for k in BUG_TEXT_FIELDS if not isinstance(record.get(k), str) or not record[k].strip()]
    if unknown or missing:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}, missing or empty {missing}")
    if record["file"] not in files:
        raise ValueError(f"{where}: no file {record['file']!r}; the library has {sorted(files)}")
    params = tuple(sorted((record.get("params") or {}).items()))
    bug = Bug(
        record["file"],
        record["where"],
        record["operator"],
        params,
        str(record.get("match", "")),
        record.get("occurrence"),
        record["title"].strip(),
        record["story"].strip(),
        record["repro"],
        record["explanation"].strip(),
    )
    try:
        bug.edit(files[bug.file])
    except MutationError as e:
        raise ValueError(f"{where}: {e}") from None
    return bug


def load_libraries(root: Path = LIBS_DIR) -> list[Library]:
    """Every library under `root` (a folder with a `bugs.yaml`), by name."""
    return [load_library(p.parent) for p in sorted(root.glob("*/bugs.yaml"))]
