"""Write the demonstration for one generated task: explore, reproduce, read, fix, check, test, submit.

The fix is the reverse of the injected edit, written the way an agent at a shell would write it: a
`sed` substitution on the numbered line when one line changes and quoting allows, otherwise a short
Python script (in a heredoc) that replaces a uniquely matching block of lines.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import shlex
import string

from swebench_env.demos import SUBMIT_COMMAND, Demonstration, Step
from swebench_env.suite.library import Bug
from swebench_env.suite.mutations import Module

LIST_FILES = "find . -name '*.py' -not -path './.git/*' | sort"


def make_demonstration(instance_id: str, bug: Bug, buggy: str, correct: str) -> Demonstration:
    """The steps that find and fix `bug` in file `bug.file`, whose buggy and correct texts are given."""
    first, last = _view_range(bug, buggy, correct)
    run_repro = f"python - <<'EOF'\n{bug.repro.rstrip()}\nEOF"
    place = "the module-level definitions" if bug.where == "<module>" else f"`{bug.where}`"
    steps = (
        Step("Let me look at the layout of the repository first.", LIST_FILES),
        Step("I'll reproduce the problem from the issue.", run_repro),
        Step(
            f"The behaviour in the issue comes from {place} in {bug.file}. Let me find it.",
            _locate(bug, buggy, correct),
        ),
        Step("Let me read that code with line numbers.", f"nl -ba {shlex.quote(bug.file)} | sed -n '{first},{last}p'"),
        Step(f"{bug.explanation} I'll fix that.", edit_command(bug.file, buggy, correct)),
        Step("Let me run the reproduction again to check the fix.", run_repro),
        Step("And the existing tests, to make sure nothing else broke.", "python -m pytest -q"),
        Step("The fix works and the tests pass, so I'll submit.", SUBMIT_COMMAND),
    )
    return Demonstration(instance_id, steps)


def _changed_lines(buggy: str, correct: str) -> tuple[list[str], list[str], tuple[int, int, int, int]]:
    a, b = buggy.splitlines(keepends=True), correct.splitlines(keepends=True)
    blocks = [op[1:] for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if len(blocks) != 1:
        raise ValueError(f"expected one changed block of lines, found {len(blocks)}")
    return a, b, blocks[0]


def _view_range(bug: Bug, buggy: str, correct: str) -> tuple[int, int]:
    """1-based first and last line to show: the bug's function, or the top-level statement holding the edit."""
    node = _site(bug, buggy, correct)
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return first, node.end_lineno


def _site(bug: Bug, buggy: str, correct: str) -> ast.AST:
    """The function `bug.where`, or for `<module>` the top-level statement that holds the changed lines."""
    module = Module(buggy)
    if bug.where != "<module>":
        return module.function(bug.where)
    _, _, (i1, _, _, _) = _changed_lines(buggy, correct)
    return next(s for s in module.tree.body if s.lineno <= i1 + 1 <= s.end_lineno)


def _locate(bug: Bug, buggy: str, correct: str) -> str:
    """A grep for the definition of the function (or the module-level name) the bug sits in."""
    if bug.where != "<module>":
        return f"grep -n {shlex.quote('def ' + bug.where.split('.')[-1])} {shlex.quote(bug.file)}"
    site = _site(bug, buggy, correct)
    targets = getattr(site, "targets", None) or [getattr(site, "target", None)]
    name = targets[0].id if isinstance(targets[0], ast.Name) else bug.file.rsplit("/", 1)[-1].removesuffix(".py")
    return f"grep -rn {shlex.quote(name + ' =')} --include='*.py' ."


def edit_command(path: str, buggy: str, correct: str) -> str:
    """A shell command that turns the file `path` from `buggy` into `correct` (they differ in one block)."""
    a, b, (i1, i2, j1, j2) = _changed_lines(buggy, correct)
    if i2 - i1 == 1 and j2 - j1 == 1 and "'" not in a[i1] + b[j1] and a[i1].strip():
        old, new = _smallest_change(a[i1].rstrip("\n"), b[j1].rstrip("\n"))
        return f"sed -i '{i1 + 1}s/{_sed_pattern(old)}/{_sed_replacement(new)}/' {shlex.quote(path)}"
    for context in range(0, max(len(a), len(b)) + 1):
        old = "".join(a[max(0, i1 - context) : i2 + context])
        new = "".join(b[max(0, j1 - context) : j2 + context])
        if old and buggy.count(old) == 1:
            return _python_replace(path, old, new)
    raise ValueError(f"no unique block of lines to replace in {path}")


def _smallest_change(old: str, new: str) -> tuple[str, str]:
    """The shortest (old, new) fragments, grown to whole words or operators, with `old` first found where it
    changes, so that replacing the first `old` in the line with `new` gives the new line."""
    prefix = len(os.path.commonprefix([old, new]))
    suffix = len(os.path.commonprefix([old[prefix:][::-1], new[prefix:][::-1]]))
    start, end = prefix, len(old) - suffix
    word = set(string.ascii_letters + string.digits + "_")
    start, end = _grow(old, start, end, word)
    if not any(c.isalnum() for c in old[start:end]) or start == end:
        start, end = _grow(old, start, end, set(string.printable) - set(string.whitespace))
    while old.find(old[start:end]) != start:
        start -= 1
    fragments = old[start:end], new[start : len(new) - (len(old) - end)]
    if not fragments[0] or old.replace(fragments[0], fragments[1], 1) != new:
        return old.strip(), new.strip()
    return fragments


def _grow(text: str, start: int, end: int, chars: set[str]) -> tuple[int, int]:
    while start > 0 and text[start - 1] in chars:
        start -= 1
    while end < len(text) and text[end] in chars:
        end += 1
    return start, end


def _sed_pattern(text: str) -> str:
    return re.sub(r"([\\/.*\[\]^$])", r"\\\1", text)


def _sed_replacement(text: str) -> str:
    return re.sub(r"([\\/&])", r"\\\1", text)


def _literal(text: str) -> str:
    """A Python literal for `text`: triple-quoted where that reads back exactly, else repr."""
    if "\\" not in text and "'''" not in text and not text.endswith("'"):
        return f"'''{text}'''"
    return repr(text)


def _python_replace(path: str, old: str, new: str) -> str:
    script = (
        "from pathlib import Path\n\n"
        f"path = Path({path!r})\n"
        "text = path.read_text()\n"
        f"old = {_literal(old)}\n"
        f"new = {_literal(new)}\n"
        'assert text.count(old) == 1, "the block to replace must occur exactly once"\n'
        "path.write_text(text.replace(old, new))\n"
    )
    return f"python - <<'EOF'\n{script}EOF"
