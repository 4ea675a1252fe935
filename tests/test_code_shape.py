"""The code's shape, held: no library file over 600 lines, and the formatter's output kept (hardly any
`# fmt: skip`). Library code is every package a user imports (tests, experiments and benchmarks are scripts)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("core", "sim", "reference", "swebench_env")
MAX_LINES = 600
MAX_FMT_SKIPS = 30


def _library_files() -> list[Path]:
    return sorted(p for package in LIBRARY for p in (ROOT / package).rglob("*.py"))


def test_the_library_is_found():
    assert len(_library_files()) > 100


def test_no_library_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _library_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these along their seams (at most {MAX_LINES} lines a file): {long}"


def test_the_formatter_is_hardly_ever_overridden():
    skips = {str(p.relative_to(ROOT)): n for p in _library_files() if (n := p.read_text().count("# fmt: skip"))}
    assert sum(skips.values()) < MAX_FMT_SKIPS, f"`# fmt: skip` in library code: {skips}"
