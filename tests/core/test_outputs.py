"""core.outputs: the checks on an output folder, unique default folders, what --overwrite refuses to clear,
provenance, and progress bars only on a terminal."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from core.errors import UserError
from core.outputs import (
    ROOT,
    configs_hash,
    default_out,
    interrupted,
    prepare_out,
    provenance,
    provenance_header,
    refusal_to_clear,
    show_progress,
)


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_default_folder_taken_in_the_same_second_gets_a_suffix(tmp_path):
    base = tmp_path / "results" / "sim-tag-20250101-120000-seed0"
    made = [prepare_out(None, base) for _ in range(3)]
    assert [p.name for p in made] == [base.name, f"{base.name}-2", f"{base.name}-3"]
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)


def test_default_folders_name_the_kind_label_and_seed():
    path = default_out("train", "compare", 7)
    assert path.parent == Path("results")
    assert path.name.startswith("train-compare-")
    assert path.name.endswith("-seed7")


def test_a_new_folder_is_created_with_its_parents(tmp_path):
    out = prepare_out(tmp_path / "a" / "b", tmp_path / "unused")
    assert out == tmp_path / "a" / "b"
    assert out.is_dir()
    assert tree(tmp_path) == ["a", "a/b"]


def test_an_empty_folder_is_used_as_it_is(tmp_path):
    assert prepare_out(tmp_path, tmp_path / "unused") == tmp_path
    assert tree(tmp_path) == []


def a_file(d: Path) -> None:
    (d / "f").write_text("x")


def a_full_folder(d: Path) -> None:
    (d / "full").mkdir()
    (d / "full" / "old.json").write_text("{}")


@pytest.mark.parametrize(
    ("make", "out", "message"),
    [
        (a_file, "f", "--out '{d}/f' is a file, not a folder"),
        (a_file, "f/sub", "--out '{d}/f/sub' cannot be created: Not a directory"),
        (a_full_folder, "full", "--out '{d}/full' is not empty; choose a new folder or pass --overwrite"),
    ],
)
def test_an_unusable_out_is_one_message_and_writes_nothing(tmp_path, make, out, message):
    make(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(UserError) as caught:
        prepare_out(tmp_path / out, tmp_path / "unused")
    assert str(caught.value) == message.format(d=tmp_path)
    assert tree(tmp_path) == before


@pytest.mark.skipif(sys.platform != "linux", reason="/proc refuses new folders even to root on Linux")
def test_a_folder_that_cannot_be_created_names_the_reason(tmp_path):
    with pytest.raises(UserError, match=r"^--out '/proc/no-such-run' cannot be created: No such file or directory$"):
        prepare_out("/proc/no-such-run", tmp_path / "unused")


def test_overwrite_clears_only_what_is_inside(tmp_path):
    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (out / "sub").mkdir(parents=True)
    (out / "timeline.png").write_bytes(b"old")
    (out / "sub" / "summary.json").write_text("{}")
    (out / "link").symlink_to(outside)  # removed as a link; what it points to stays
    assert prepare_out(out, tmp_path / "unused", overwrite=True) == out
    assert tree(out) == []
    assert (outside / "keep.txt").read_text() == "keep"


def test_overwrite_refuses_the_current_folder_and_the_folders_holding_it(tmp_path, monkeypatch):
    work = tmp_path / "a" / "work"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out, what in ((".", "the current folder"), (tmp_path / "a", "a folder holding the current folder")):
        with pytest.raises(UserError, match=f"--overwrite refuses to clear .*: it is {what}$"):
            prepare_out(out, tmp_path / "unused", overwrite=True)
    assert (work / "notes.txt").read_text() == "mine"


def test_overwrite_refuses_the_home_folder(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".profile").write_text("mine")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(UserError, match="it is the home folder$"):
        prepare_out(home, tmp_path / "unused", overwrite=True)
    assert (home / ".profile").read_text() == "mine"


def test_what_overwrite_would_never_clear(tmp_path, monkeypatch):
    """Asked of `refusal_to_clear` itself: a bug here must not be able to clear these folders in a test."""
    monkeypatch.chdir(tmp_path)
    assert refusal_to_clear(Path("/")) == "the filesystem root"
    assert refusal_to_clear(ROOT) == "the repository root"
    # (or "... the current folder" where the temporary folder is beside the checkout)
    assert refusal_to_clear(ROOT.parent).startswith("a folder holding the")
    (tmp_path / "checkout" / ".git").mkdir(parents=True)
    assert refusal_to_clear(tmp_path / "checkout") == "a git checkout"
    assert refusal_to_clear(tmp_path / "checkout" / ".git") == ""


def test_provenance_names_the_policy_the_command_and_the_source(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/sim/__main__.py", "--policy", "tag", "--set", "seed=3"])
    record = provenance("tag")
    assert record["policy"] == "tag"
    assert record["argv"] == ["/x/sim/__main__.py", "--policy", "tag", "--set", "seed=3"]
    source = record["source"]
    assert source["configs_sha256"] == configs_hash()
    if (ROOT / ".git").exists():
        assert len(source["git_commit"]) == 40
        assert isinstance(source["git_dirty"], bool)
    else:
        assert source["version"]


def test_the_configs_hash_covers_every_shipped_config(tmp_path):
    for name in ("core/specs/models.yaml", "sim/configs/default.yaml", "reference/configs/train.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("a: 1\n")
    first = configs_hash(tmp_path)
    assert len(first) == 64
    (tmp_path / "reference/configs/train.yaml").write_text("a: 2\n")
    assert configs_hash(tmp_path) != first
    (tmp_path / "sim/configs/notes.txt").write_text("not a config")
    assert configs_hash(tmp_path) == configs_hash(tmp_path)


def test_the_provenance_header_is_comments_with_one_json_value_a_line():
    record = {"policy": "tag", "argv": ["a b", "c"], "source": {"version": "0.1.0"}}
    lines = provenance_header(record).splitlines()
    assert all(line.startswith("# ") for line in lines)
    parsed = dict(line[2:].split(": ", 1) for line in lines[1:])
    assert {key: json.loads(value) for key, value in parsed.items()} == record


def test_the_interrupted_line_says_where_the_outputs_are(tmp_path):
    assert interrupted(None) == "interrupted (Ctrl-C); no outputs were written"
    assert interrupted(tmp_path) == "interrupted (Ctrl-C); no outputs were written"
    (tmp_path / "summary.json").write_text("{}")
    assert interrupted(tmp_path) == f"interrupted (Ctrl-C); outputs written so far are in {tmp_path}/"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stderr", "requested", "shown"), [
    (Terminal(), True, True), (Terminal(), False, False), (io.StringIO(), True, False),
])  # fmt: skip
def test_progress_bars_only_on_a_terminal(monkeypatch, stderr, requested, shown):
    monkeypatch.setattr(sys, "stderr", stderr)
    assert show_progress(requested) is shown
