"""The shipped suite: its shape and splits, a sample of tasks verified by running them, and the generator's
determinism (a rebuilt task is byte-identical to the shipped one). Verifying every task and regenerating
the whole suite are marked slow."""

from __future__ import annotations

import json

import pytest

from swebench_env.evaluation import patch_files
from swebench_env.suite import HELD_OUT_LIBRARIES, SUITE_DIR, load_suite, load_suite_demonstrations
from swebench_env.suite.build import build_task, generate_suite, split_of
from swebench_env.suite.library import LIBS_DIR, load_libraries, load_library
from swebench_env.suite.verify import check_task, check_tasks

# One task per kind of demonstration edit: a heredoc block (intervalset-3), a `sed` on a module-level table
# (rpncalc-1), and a held-out task (semver-1).
SAMPLE = ("swesuite__intervalset-3", "swesuite__rpncalc-1", "swesuite__semver-1")


@pytest.fixture(scope="module")
def tasks():
    return {t.instance_id: t for t in load_suite("all")}


@pytest.fixture(scope="module")
def demos():
    return {d.instance_id: d for d in load_suite_demonstrations("all")}


def test_suite_has_at_least_30_tasks_with_unique_ids(tasks):
    assert len(tasks) >= 30
    assert len(load_suite("train")) + len(load_suite("held_out")) == len(tasks)


def test_splits_are_disjoint_and_split_by_library():
    train = {t.instance_id for t in load_suite("train")}
    held_out = {t.instance_id for t in load_suite("held_out")}
    assert not train & held_out
    assert {t.repo.split("/")[1] for t in load_suite("held_out")} == set(HELD_OUT_LIBRARIES)
    assert not {t.repo.split("/")[1] for t in load_suite("train")} & set(HELD_OUT_LIBRARIES)
    assert len(held_out) >= 8


def test_splits_are_fixed_by_the_manifest():
    manifest = json.loads((SUITE_DIR / "manifest.json").read_text())
    assert manifest["splits"]["train"] == [t.instance_id for t in load_suite("train")]
    assert manifest["splits"]["held_out"] == [t.instance_id for t in load_suite("held_out")]


def test_every_task_has_a_demonstration_a_bundle_and_clean_patches(tasks, demos):
    assert set(demos) == set(tasks)
    for task in tasks.values():
        assert task.repo_path.is_file()
        assert task.repo_path.parent == SUITE_DIR / "repos"
        assert all(not p.startswith("tests/") for p in patch_files(task.patch))
        assert all(p.startswith("tests/") for p in patch_files(task.test_patch))


def test_problem_statements_describe_the_symptom_not_the_fix(tasks):
    for task in tasks.values():
        assert "but I expected" in task.problem_statement
        assert "diff --git" not in task.problem_statement
        lines = task.patch.splitlines()
        added = [x[1:].strip() for x in lines if x.startswith("+") and not x.startswith("+++") and x[1:].strip()]
        assert not [line for line in added if line in task.problem_statement], task.instance_id


def test_suite_is_small_on_disk():
    size = sum(f.stat().st_size for f in SUITE_DIR.rglob("*") if f.is_file())
    assert size < 1_000_000


def test_unknown_split_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown split 'test'; choose one of \['train', 'held_out', 'all'\]"):
        load_suite("test")


@pytest.mark.parametrize("instance_id", SAMPLE)
def test_sampled_task_verifies(instance_id, tasks, demos):
    check = check_task(tasks[instance_id], demos[instance_id])
    assert check.problems == ()


@pytest.mark.parametrize(("library", "number"), [("intervalset", 3), ("rpncalc", 1)])
def test_rebuilding_a_task_gives_the_shipped_task(library, number, tasks, demos, tmp_path):
    built = build_task(load_library(LIBS_DIR / library), number, tmp_path)
    shipped = tasks[built.task.instance_id]
    assert built.task.to_dict(relative_to=tmp_path) == shipped.to_dict(relative_to=SUITE_DIR / "repos")
    assert built.demonstration == demos[built.task.instance_id]
    assert built.task.repo_path.read_bytes() == shipped.repo_path.read_bytes()
    assert built.split == split_of(library)


@pytest.mark.slow
def test_every_task_verifies(tasks, demos):
    checks = check_tasks(list(tasks.values()), demos, jobs=2)
    assert {c.instance_id: c.problems for c in checks if not c.ok} == {}


@pytest.mark.slow
def test_regenerating_the_suite_gives_identical_files(tmp_path):
    generate_suite(tmp_path / "suite", jobs=2, libraries=load_libraries())
    shipped = {p.relative_to(SUITE_DIR): p.read_bytes() for p in SUITE_DIR.rglob("*") if p.is_file()}
    rebuilt = {
        p.relative_to(tmp_path / "suite"): p.read_bytes() for p in (tmp_path / "suite").rglob("*") if p.is_file()
    }
    assert sorted(rebuilt) == sorted(shipped)
    assert [p for p in shipped if rebuilt[p] != shipped[p]] == []
