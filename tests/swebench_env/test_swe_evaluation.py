"""Grading rules, pytest log parsing, local evaluation of patches, and demonstrations as data."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest

from swebench_env.demos import (
    SUBMIT_COMMAND,
    SUBMIT_MARKER,
    Demonstration,
    Step,
    StepResult,
    dump_demonstrations,
    load_demonstrations,
    replay,
    submitted_patch,
)
from swebench_env.evaluation import (
    Outcome,
    Verdict,
    evaluate_locally,
    grade,
    judged_files,
    parse_pytest_log,
    patch_files,
    pytest_command,
)
from swebench_env.suite import load_suite
from swebench_env.tasks import materialize_repo

LOG = """\
..F.sE
=========================== short test summary info ============================
PASSED tests/test_a.py::test_one
PASSED tests/test_a.py::test_two[1-2]
XFAIL tests/test_a.py::test_known - reason: flaky
SKIPPED [1] tests/test_a.py:40: needs network
FAILED tests/test_a.py::test_three - AssertionError: assert 1 == 2
ERROR tests/test_b.py::test_setup - RuntimeError: boom
ERROR tests/test_c.py - ImportError: no module named c
1 failed, 2 passed, 1 skipped, 1 xfailed, 2 errors in 0.05s
"""


@pytest.fixture(scope="module")
def task():
    return next(t for t in load_suite("train") if t.instance_id == "swesuite__intervalset-3")


def test_parse_pytest_log_reads_the_short_summary():
    assert parse_pytest_log(LOG) == {
        "tests/test_a.py::test_one": Outcome.PASSED,
        "tests/test_a.py::test_two[1-2]": Outcome.PASSED,
        "tests/test_a.py::test_known": Outcome.XFAIL,
        "tests/test_a.py::test_three": Outcome.FAILED,
        "tests/test_b.py::test_setup": Outcome.ERROR,
        "tests/test_c.py": Outcome.ERROR,  # a module that failed to import: SWE-bench records it too
    }


def test_grade_needs_every_listed_test_to_pass(task):
    everything = {t: Outcome.PASSED for t in (*task.FAIL_TO_PASS, *task.PASS_TO_PASS)}
    f2p, p2p = len(task.FAIL_TO_PASS), len(task.PASS_TO_PASS)
    assert grade(task, everything) == Verdict(True, (f2p, f2p), (p2p, p2p))
    one_failed = {**everything, task.FAIL_TO_PASS[0]: Outcome.FAILED}
    assert grade(task, one_failed) == Verdict(False, (f2p - 1, f2p), (p2p, p2p))
    one_missing = {t: s for t, s in everything.items() if t != task.PASS_TO_PASS[0]}
    assert grade(task, one_missing) == Verdict(False, (f2p, f2p), (p2p - 1, p2p))


def test_patch_files_and_the_test_command(task):
    assert patch_files(task.patch) == ["intervalset.py"]
    assert judged_files(task) == ["tests/test_intervalset.py"]
    assert pytest_command(task)[-1] == "tests/test_intervalset.py"
    assert pytest_command(task)[:4] == ["python", "-m", "pytest", "-rA"]


def test_gold_patch_resolves_and_empty_patch_does_not(task):
    gold = evaluate_locally(task, task.patch)
    assert gold.applied
    assert gold.resolved
    empty = evaluate_locally(task, "")
    assert not empty.resolved
    assert {empty.statuses[t] for t in task.FAIL_TO_PASS} == {Outcome.FAILED}


def test_a_patch_that_does_not_apply_is_a_result(task):
    broken = task.patch.replace("result.append(Interval(item.start, start))", "something else entirely")
    outcome = evaluate_locally(task, broken)
    assert not outcome.applied
    assert not outcome.resolved
    assert "git apply" in outcome.log


def test_a_local_run_past_its_timeout_is_killed_and_graded_as_timed_out(task, tmp_path):
    repo = materialize_repo(task, tmp_path / "repo")
    source = repo / patch_files(task.patch)[0]
    source.write_text(source.read_text() + "\nimport time\ntime.sleep(3600)\n")
    hang = subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout
    outcome = evaluate_locally(task, hang, timeout_s=2)
    assert outcome.problem == "the tests timed out"
    assert outcome.statuses == {}
    assert not outcome.resolved


def test_edits_to_the_judging_tests_are_undone(task):
    cheat = task.test_patch.replace("assert list(s) == [(0, 4), (6, 10)]", "assert True")
    outcome = evaluate_locally(task, cheat)
    assert outcome.applied
    assert not outcome.resolved


def new_file_diff(path: str, lines: list[str]) -> str:
    body = "".join(f"+{line}\n" for line in lines)
    header = f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
    return f"{header}@@ -0,0 +1,{len(lines)} @@\n{body}"


def test_a_patch_that_creates_the_judging_test_file_cannot_block_it(task):
    judged = replace(
        task, test_patch=task.test_patch + new_file_diff("tests/test_extra.py", ["def test_extra():", "    pass"])
    )
    outcome = evaluate_locally(judged, task.patch + new_file_diff("tests/test_extra.py", ["x = 1"]))
    assert outcome.applied
    assert outcome.resolved


def demo(*commands: str) -> Demonstration:
    return Demonstration("x-1", tuple(Step(f"step {i}", c) for i, c in enumerate((*commands, SUBMIT_COMMAND))))


def test_demonstration_must_end_by_submitting():
    with pytest.raises(ValueError, match="the last step must run"):
        Demonstration("x-1", (Step("look", "ls"),))


def test_demonstrations_round_trip_through_jsonl(tmp_path):
    demos = [demo("ls", "cat <<'EOF'\nhi\nEOF")]
    path = dump_demonstrations(demos, tmp_path / "d.jsonl")
    assert load_demonstrations(path) == demos
    assert json.loads(path.read_text())["steps"][0] == {"thought": "step 0", "command": "ls"}


def test_bad_demonstration_line_names_the_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"instance_id": "x"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl line 1: a demonstration needs 'instance_id' and 'steps'"):
        load_demonstrations(tmp_path / "d.jsonl")


def test_replay_keeps_failures_as_results_and_submits_the_diff(task, tmp_path):
    repo = materialize_repo(task, tmp_path / "repo")
    results = replay(demo("exit 3", "echo '# note' >> README.md"), repo)
    assert [r.returncode for r in results] == [3, 0, 0]
    patch = submitted_patch(results)
    assert patch.startswith("diff --git a/README.md b/README.md")
    assert "+# note" in patch


def test_submitted_patch_needs_the_marker():
    assert submitted_patch([StepResult("ls", 0, "a\nb\n")]) is None
    assert submitted_patch([StepResult(SUBMIT_COMMAND, 0, f"{SUBMIT_MARKER}\ndiff\n")]) == "diff\n"
