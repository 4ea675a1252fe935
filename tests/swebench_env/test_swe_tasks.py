"""Task files: JSON and JSONL, SWE-bench's string-encoded test lists, every kind of bad input, and checkouts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from swebench_env.git import GitError, deterministic_env, git
from swebench_env.tasks import (
    TaskFormatError,
    dump_tasks,
    load_tasks,
    materialize_repo,
    parse_tasks,
    task_from_dict,
)

SHA = "a" * 40


def record(**changes) -> dict:
    """A valid official-looking record (GitHub repo, string-encoded test lists), with `changes` applied."""
    base = {
        "repo": "astropy/astropy",
        "instance_id": "astropy__astropy-12907",
        "base_commit": SHA,
        "patch": "diff --git a/x.py b/x.py\n",
        "test_patch": "diff --git a/tests/test_x.py b/tests/test_x.py\n",
        "problem_statement": "Something is wrong",
        "hints_text": "",
        "created_at": "2022-03-03T15:14:54Z",
        "version": "4.3",
        "FAIL_TO_PASS": '["tests/test_x.py::test_a"]',
        "PASS_TO_PASS": '["tests/test_x.py::test_b", "tests/test_x.py::test_c[1-2]"]',
        "environment_setup_commit": "b" * 40,
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def test_official_record_loads_with_string_encoded_test_lists():
    task = task_from_dict(record())
    assert task.FAIL_TO_PASS == ("tests/test_x.py::test_a",)
    assert task.PASS_TO_PASS == ("tests/test_x.py::test_b", "tests/test_x.py::test_c[1-2]")
    assert task.repo_path is None
    assert task.version == "4.3"


def test_plain_lists_load_too():
    task = task_from_dict(record(FAIL_TO_PASS=["t.py::a"], PASS_TO_PASS=[]))
    assert task.FAIL_TO_PASS == ("t.py::a",)
    assert task.PASS_TO_PASS == ()


def test_optional_fields_default_and_setup_commit_falls_back_to_base():
    task = task_from_dict(record(hints_text=..., created_at=..., version=..., environment_setup_commit=None))
    assert (task.hints_text, task.created_at, task.version) == ("", "", "")
    assert task.environment_setup_commit == SHA


def test_json_list_and_jsonl_give_the_same_tasks(tmp_path):
    records = [record(), record(instance_id="astropy__astropy-13033")]
    as_json = tmp_path / "tasks.json"
    as_jsonl = tmp_path / "tasks.jsonl"
    as_json.write_text(json.dumps(records, indent=2))
    as_jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert load_tasks(as_json) == load_tasks(as_jsonl)
    assert [t.instance_id for t in load_tasks(as_json)] == ["astropy__astropy-12907", "astropy__astropy-13033"]


def test_extra_fields_are_kept_and_written_back(tmp_path):
    task = task_from_dict(record(difficulty="<15 min fix"))
    assert task.extra == {"difficulty": "<15 min fix"}
    out = dump_tasks([task], tmp_path / "out.jsonl")
    assert load_tasks(out) == [task]
    assert json.loads(out.read_text())["difficulty"] == "<15 min fix"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"patch": ...}, r"instance 'astropy__astropy-12907': missing field\(s\) \['patch'\]"),
        ({"FAIL_TO_PASS": 3}, r"field 'FAIL_TO_PASS': expected a list of test id strings"),
        ({"FAIL_TO_PASS": "not json"}, r"field 'FAIL_TO_PASS': a string must be a JSON-encoded list"),
        ({"FAIL_TO_PASS": "[]"}, r"field 'FAIL_TO_PASS': expected at least one test"),
        ({"PASS_TO_PASS": ["ok", 5]}, r"field 'PASS_TO_PASS': expected a list of test id strings"),
        ({"base_commit": "abc123"}, r"field 'base_commit': expected a full 40-hex-digit commit id, got 'abc123'"),
        ({"repo": "astropy"}, r"field 'repo': expected GitHub's 'owner/name' \(or give 'repo_path'\)"),
        ({"version": 4.3}, r"field 'version': expected a string, got float 4.3"),
        ({"instance_id": "a b"}, r"field 'instance_id': use letters, digits and _.-"),
        ({"FAIL_TO_PAS": "[]"}, r"unknown field 'FAIL_TO_PAS' \(did you mean 'FAIL_TO_PASS'\?\)"),
        ({"repo_pth": "x"}, r"unknown field 'repo_pth' \(did you mean 'repo_path'\?\)"),
    ],
)
def test_bad_records_name_the_instance_field_and_what_is_allowed(changes, message):
    with pytest.raises(TaskFormatError, match=message):
        task_from_dict(record(**changes))


def test_errors_name_the_line_of_the_file():
    text = json.dumps(record()) + "\n" + json.dumps(record(instance_id="x-2", base_commit="nope")) + "\n"
    with pytest.raises(TaskFormatError, match=r"^tasks.jsonl line 2: instance 'x-2': field 'base_commit'"):
        parse_tasks(text, source="tasks.jsonl")


def test_invalid_json_is_reported_with_its_place():
    with pytest.raises(TaskFormatError, match=r"^t.jsonl line 2: not valid JSON"):
        parse_tasks(json.dumps(record()) + "\n{oops\n", source="t.jsonl")
    with pytest.raises(TaskFormatError, match=r"^t.json: not valid JSON"):
        parse_tasks("[{", source="t.json")


def test_a_record_must_be_an_object():
    with pytest.raises(TaskFormatError, match=r"t.json item 0: expected a JSON object per task, got list"):
        parse_tasks("[[1, 2]]", source="t.json")


def test_duplicate_ids_are_refused_with_both_places():
    with pytest.raises(TaskFormatError, match=r"t.jsonl line 2: duplicate instance_id 'astropy__astropy-12907' "):
        parse_tasks(json.dumps(record()) + "\n" + json.dumps(record()) + "\n", source="t.jsonl")


def test_missing_repo_path_is_refused(tmp_path):
    text = json.dumps(record(repo="mine/lib", repo_path="repos/lib.bundle"))
    with pytest.raises(TaskFormatError, match=r"field 'repo_path': 'repos/lib.bundle' does not exist"):
        parse_tasks(text, base_dir=tmp_path)


def test_repo_path_folder_must_be_a_repository(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(TaskFormatError, match=r"is a folder but not a git repository"):
        parse_tasks(json.dumps(record(repo="any label", repo_path="plain")), base_dir=tmp_path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="task file .*nope.jsonl does not exist"):
        load_tasks(tmp_path / "nope.jsonl")


@pytest.fixture
def local_repo(tmp_path) -> tuple[Path, str, str]:
    """A git repository with two commits: (path, first commit, second commit)."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    env = deterministic_env("2024-01-01T00:00:00+00:00")
    git("init", "-q", "-b", "trunk", cwd=repo, env=env)
    commits = []
    for text in ("def f():\n    return 1\n", "def f():\n    return 2  # the fix\n"):
        (repo / "lib.py").write_text(text)
        git("add", "-A", cwd=repo, env=env)
        git("commit", "-q", "-m", text[:20], cwd=repo, env=env)
        commits.append(git("rev-parse", "HEAD", cwd=repo, env=env).strip())
    return repo, commits[0], commits[1]


def test_local_task_checks_out_at_its_base_commit_without_later_commits(tmp_path, local_repo):
    repo, first, second = local_repo
    tasks_file = tmp_path / "mine.jsonl"
    tasks_file.write_text(json.dumps(record(repo="me/lib", repo_path="upstream", base_commit=first)) + "\n")
    [task] = load_tasks(tasks_file)
    assert task.repo_path == repo.resolve()
    dest = materialize_repo(task, tmp_path / "checkout")
    assert (dest / "lib.py").read_text() == "def f():\n    return 1\n"
    assert git("rev-parse", "HEAD", cwd=dest).strip() == first
    assert git("rev-parse", "--abbrev-ref", "HEAD", cwd=dest).strip() == "main"
    assert git("cat-file", "-t", second, cwd=repo).strip() == "commit"
    assert not git("remote", cwd=dest).strip()
    with pytest.raises(GitError, match="cat-file"):
        git("cat-file", "-t", second, cwd=dest)


def test_bundle_task_checks_out(tmp_path, local_repo):
    repo, first, _ = local_repo
    git("bundle", "create", "-q", str(tmp_path / "lib.bundle"), "--all", cwd=repo)
    task = replace(task_from_dict(record()), repo_path=tmp_path / "lib.bundle", base_commit=first)
    dest = materialize_repo(task, tmp_path / "checkout")
    assert (dest / "lib.py").read_text().endswith("return 1\n")


def test_shallow_checkout_keeps_only_the_last_commits(tmp_path, local_repo):
    repo, _, second = local_repo
    task = replace(task_from_dict(record()), repo_path=repo, base_commit=second)
    dest = materialize_repo(task, tmp_path / "checkout", depth=1)
    assert git("rev-list", "--count", "HEAD", cwd=dest).strip() == "1"


def test_checkout_refuses_a_non_empty_folder(tmp_path, local_repo):
    repo, first, _ = local_repo
    task = replace(task_from_dict(record()), repo_path=repo, base_commit=first)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is not empty"):
        materialize_repo(task, tmp_path / "busy")


def test_checkout_of_an_unknown_commit_says_what_git_said(tmp_path, local_repo):
    repo, _, _ = local_repo
    task = replace(task_from_dict(record()), repo_path=repo, base_commit="c" * 40)
    with pytest.raises(GitError, match=r"`git fetch .*` in .* failed"):
        materialize_repo(task, tmp_path / "checkout")


# ---- a task's environment: the `image` and `install` fields ----


def test_environment_fields_are_read_and_written_back(tmp_path):
    install = {"pip": ["six==1.16.0", "attrs[tests]>=23; python_version >= '3.8'"], "commands": ["echo ok"]}
    task = task_from_dict(record(image="python:3.11-slim", install=install))
    assert task.environment.image == "python:3.11-slim"
    assert task.environment.install.pip == ("six==1.16.0", "attrs[tests]>=23; python_version >= '3.8'")
    assert task.environment.install.commands == ("echo ok",)
    out = dump_tasks([task], tmp_path / "out.jsonl")
    assert json.loads(out.read_text())["install"] == install


def test_a_task_without_environment_fields_names_none():
    environment = task_from_dict(record()).environment
    assert (environment.image, environment.install) == (None, None)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"image": 3}, r"field 'image': expected a Docker image name such as 'python:3.11-slim', got 3"),
        ({"image": "two words"}, r"field 'image': expected a Docker image name"),
        ({"install": ["six"]}, r"field 'install': expected an object with 'pip' .* got list"),
        ({"install": {}}, r"field 'install': empty; expected an object with 'pip'"),
        ({"install": {"pips": ["six"]}}, r"field 'install': unknown key 'pips' \(did you mean 'pip'\?\); allowed: pip"),
        ({"install": {"pip": "six"}}, r"field 'install.pip': expected a list of non-empty one-line strings"),
        ({"install": {"pip": ["--index-url=http://x"]}}, r"field 'install.pip' item 0: '--index-url=http://x' is not"),
        ({"install": {"pip": ["six", "pkg @ https://x/p.whl"]}}, r"field 'install.pip' item 1: 'pkg @ https"),
        ({"install": {"commands": ["a\nb"]}}, r"field 'install.commands': expected a list of non-empty one-line"),
        ({"instal": {"pip": ["six"]}}, r"unknown field 'instal' \(did you mean 'install'\?\)"),
        ({"imag": "python:3"}, r"unknown field 'imag' \(did you mean 'image'\?\)"),
    ],
)
def test_bad_environment_fields_are_one_line_errors(changes, message):
    with pytest.raises(TaskFormatError, match=rf"^instance 'astropy__astropy-12907': {message}") as error:
        task_from_dict(record(**changes))
    assert "\n" not in str(error.value)


def test_an_environment_field_is_checked_however_the_task_is_made():
    task = task_from_dict(record())
    with pytest.raises(TaskFormatError, match=r"field 'install.pip' item 0"):
        replace(task, extra={"install": {"pip": ["-r reqs.txt"]}})
