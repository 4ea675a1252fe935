"""derive-tests: FAIL_TO_PASS and PASS_TO_PASS from runs before and after the gold patch.

The rules are checked with a fake evaluator (statuses chosen per run); the real thing reproduces the
shipped suite's lists exactly: a few tasks in Docker and one on this machine by default, all 41 under
the `slow` marker.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from swebench_env import cli
from swebench_env.evaluation import Evaluation, Outcome, Verdict
from swebench_env.suite import SUITE_DIR, load_suite
from swebench_env.taskcheck import derive_file, derive_tests, evaluator
from swebench_env.tasks import load_tasks

P, F, E = Outcome.PASSED, Outcome.FAILED, Outcome.ERROR
SOME = ("swesuite__rpncalc-2", "swesuite__lrucache-1", "swesuite__intervalset-3")  # 7, 4 and 3 FAIL_TO_PASS


@pytest.fixture(scope="module")
def task():
    return next(t for t in load_suite("train") if t.instance_id == "swesuite__wraptext-2")


def fake(before: list[dict], after: list[dict], log: str = "", problem: str | None = None):
    """An evaluator whose k-th run without (with) the gold patch reports `before[k]` (`after[k]`)."""
    runs: dict[bool, Iterator[dict]] = {False: iter(before), True: iter(after)}

    def evaluate(task, patch: str) -> Evaluation:
        statuses = next(runs[bool(patch)])
        return Evaluation(
            task.instance_id, True, statuses, Verdict(False, (0, 1), (0, 0)), log, problem if patch else None
        )

    return evaluate


def test_fail_to_pass_is_what_the_fix_makes_pass_and_pass_to_pass_what_passes_both_times(task):
    before = {"t::a": P, "t::b": F, "t::c": E, "t::d": P, "t::e": F, "t::skip": Outcome.SKIPPED}
    after = {"t::a": P, "t::b": P, "t::c": P, "t::d": P, "t::e": F, "t::new": P, "t::skip": Outcome.SKIPPED}
    derived = derive_tests(task, fake([before], [after]))
    assert derived.problem is None
    assert derived.FAIL_TO_PASS == ("t::b", "t::c", "t::new")
    assert derived.PASS_TO_PASS == ("t::a", "t::d")


def test_a_test_the_gold_patch_breaks_is_an_error(task):
    derived = derive_tests(task, fake([{"t::a": P, "t::b": F}], [{"t::a": F, "t::b": P}]))
    assert derived.problem == "the gold patch breaks tests that pass without it: ['t::a']"


def test_a_gold_patch_that_makes_nothing_pass_is_an_error(task):
    derived = derive_tests(task, fake([{"t::a": P, "t::b": F}], [{"t::a": P, "t::b": F}]))
    assert derived.problem == "no test fails without the gold patch and passes with it"


def test_runs_must_agree(task):
    before = [{"t::a": P, "t::b": F, "t::c": P}, {"t::a": P, "t::b": F, "t::c": F}]
    after = [{"t::a": P, "t::b": P, "t::c": P}] * 2
    derived = derive_tests(task, fake(before, after), runs=2)
    assert derived.problem == "flaky: these tests pass in some of 2 runs and not in others: ['t::c']"
    assert derive_tests(task, fake(before[:1] * 2, after), runs=2).problem is None


def test_an_unusable_run_with_the_fix_says_why_and_names_a_missing_module(task):
    log = "E   ModuleNotFoundError: No module named 'numpy'\n"
    derived = derive_tests(task, fake([{}], [{}], log, problem="no test results in the log"))
    assert derived.problem.startswith(
        "with the gold patch, no test results in the log; its tests cannot import 'numpy'"
    )


@pytest.mark.docker
def test_derive_reproduces_shipped_suite_tasks_in_docker(capsys):
    code = cli.main(["derive-tests", str(SUITE_DIR / "train.jsonl"), "--ids", *SOME, "--jobs", "2"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    last = out.splitlines()[-1]
    assert last.startswith("derived 3 tasks in ")
    assert last.endswith(": 3 as in the file, 0 differ from the file, 0 errors")


def test_derive_in_place_on_this_machine_writes_the_shipped_lists(capsys, tmp_path, task):
    record = json.loads((SUITE_DIR / "train.jsonl").read_text().splitlines()[0])
    record["repo_path"] = str((SUITE_DIR / record["repo_path"]).resolve())
    shipped = {k: record.pop(k) for k in ("FAIL_TO_PASS", "PASS_TO_PASS")}
    record["PASS_TO_PASS"] = "[]"  # SWE-bench's string encoding stays a string
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(record) + "\n")
    code = cli.main(["derive-tests", str(path), "--sandbox", "local", "--in-place"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert out.endswith(": 0 as in the file, 1 differ from the file, 0 errors\n")
    written = json.loads(path.read_text())
    assert written["FAIL_TO_PASS"] == shipped["FAIL_TO_PASS"]
    assert json.loads(written["PASS_TO_PASS"]) == shipped["PASS_TO_PASS"]
    assert list(written) == [*record, "FAIL_TO_PASS"]
    assert {k: v for k, v in written.items() if k not in shipped} == {
        k: v for k, v in record.items() if k not in shipped
    }


def test_out_and_in_place_together_or_an_unknown_id_are_one_line_user_errors(capsys, tmp_path):
    tasks = str(SUITE_DIR / "train.jsonl")
    assert cli.main(["derive-tests", tasks, "--in-place", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert capsys.readouterr().err == "error: give --out FILE or --in-place, not both\n"
    assert cli.main(["derive-tests", tasks, "--ids", "nope-1", "--sandbox", "local"]) == 2
    assert capsys.readouterr().err == f"error: no task 'nope-1' in {tasks}; it has 32 records\n"


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.parametrize("split", ["train", "held_out"])
def test_derive_reproduces_every_shipped_task(split):
    path = SUITE_DIR / f"{split}.jsonl"
    derived = derive_file(Path(path), evaluator("docker"), jobs=2)
    shipped = {t.instance_id: (t.FAIL_TO_PASS, t.PASS_TO_PASS) for t in load_tasks(path)}
    assert {iid: r.problem for iid, r in derived.results.items() if not r.ok} == {}
    assert {iid: r.lists for iid, r in derived.results.items()} == shipped
