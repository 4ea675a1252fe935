"""Grading in Docker and the `eval` command: SWE-bench's procedure, log format, reports and rules.

The rules are checked against the `swebench` package itself: on synthetic logs that probe each rule
(skips, xfails, missing tests, an exit code that contradicts the log, truncated ids, timeouts), and on
the real logs of every shipped task graded in Docker with its gold and its empty patch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from swebench_env.evaluation import (
    APPLY_PATCH_FAIL,
    APPLY_PATCH_PASS,
    END_TEST_OUTPUT,
    START_TEST_OUTPUT,
    TEST_EXIT_CODE,
    TESTS_TIMEOUT,
    grade,
    patch_files,
    read_eval_log,
)
from swebench_env.grading import DockerGrader, DockerGraderConfig, GradingError, eval_script, swebench_resolved
from swebench_env.harness import load_predictions
from swebench_env.suite import SUITE_DIR, load_suite
from swebench_env.tasks import load_tasks, materialize_repo

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("swebench")


@pytest.fixture(scope="module")
def task():
    return next(t for t in load_suite("train") if t.instance_id == "swesuite__intervalset-3")


def _log(lines: list[str], code: int = 1, applied: bool = True) -> str:
    head = [APPLY_PATCH_PASS if applied else APPLY_PATCH_FAIL, START_TEST_OUTPUT]
    return "\n".join([*head, *lines, END_TEST_OUTPUT, f"{TEST_EXIT_CODE}: {code}"]) + "\n"


def _variants(task) -> dict[str, str]:
    f2p, p2p = task.FAIL_TO_PASS[0], task.PASS_TO_PASS[0]
    rest = [f"PASSED {t}" for t in (*task.FAIL_TO_PASS[1:], *task.PASS_TO_PASS[1:])]
    return {
        "all pass": _log([f"PASSED {f2p}", f"PASSED {p2p}", *rest], code=0),
        "f2p fails": _log([f"FAILED {f2p} - AssertionError", f"PASSED {p2p}", *rest]),
        "f2p xfail": _log([f"XFAIL {f2p} - known", f"PASSED {p2p}", *rest], code=0),
        "f2p skipped": _log([f"SKIPPED {f2p}", f"PASSED {p2p}", *rest], code=0),
        "p2p skipped": _log([f"PASSED {f2p}", f"SKIPPED {p2p}", *rest], code=0),
        "p2p missing": _log([f"PASSED {f2p}", *rest], code=0),
        "p2p error": _log([f"PASSED {f2p}", f"ERROR {p2p} - boom", *rest]),
        "exit code contradicts the log": _log([f"PASSED {f2p}", f"PASSED {p2p}", *rest], code=2),
        "timed out": _log([f"PASSED {f2p}", f"PASSED {p2p}", *rest], code=124) + TESTS_TIMEOUT + "\n",
        "patch did not apply": f"{APPLY_PATCH_FAIL}\n",
        "no markers": f"PASSED {f2p}\nPASSED {p2p}\n" + "\n".join(rest),
        "later line wins": _log([f"FAILED {f2p}", f"PASSED {f2p}", f"PASSED {p2p}", *rest], code=0),
    }


def test_our_rules_agree_with_the_swebench_package_on_every_probe(task):
    verdicts = {}
    for name, log in _variants(task).items():
        statuses, _ = read_eval_log(log)
        ours = grade(task, statuses).resolved
        assert ours == swebench_resolved(task, log, "diff --git a/x b/x\n"), name
        verdicts[name] = ours
    resolved = {name for name, ok in verdicts.items() if ok}
    assert resolved == {"all pass", "f2p xfail", "p2p skipped", "later line wins"}


def test_truncated_parametrized_ids_match_as_swebench_matches_them(task):
    truncated = replace(task, FAIL_TO_PASS=("tests/test_x.py::test_p[a",))
    log = _log(["PASSED tests/test_x.py::test_p[a b]", *(f"PASSED {t}" for t in task.PASS_TO_PASS)], code=0)
    statuses, problem = read_eval_log(log)
    assert problem is None
    assert grade(truncated, statuses).resolved is True
    assert swebench_resolved(truncated, log, "x") is True


def test_untrusted_logs_say_why(task):
    variants = _variants(task)
    assert read_eval_log(variants["timed out"]) == ({}, "the tests timed out")
    assert read_eval_log(variants["patch did not apply"]) == ({}, "the patch did not apply")
    assert read_eval_log(variants["no markers"]) == ({}, "the log has no test output")
    assert "exited with status 2" in read_eval_log(variants["exit code contradicts the log"])[1]


def test_eval_script_resets_the_judged_files_and_times_the_tests(task):
    script = eval_script(task, 42)
    assert "git checkout -q" in script and task.base_commit in script
    assert "timeout -k 10 42 python -m pytest" in script
    assert script.index(APPLY_PATCH_PASS) < script.index("test.patch") < script.index(START_TEST_OUTPUT)


def test_predictions_load_from_a_list_an_object_keyed_by_id_and_jsonl(tmp_path):
    records = [{"instance_id": f"a__b-{i}", "model_patch": "", "model_name_or_path": "m/x"} for i in range(3)]
    forms = {
        "list.json": json.dumps(records),
        "keyed.json": json.dumps({r["instance_id"]: r for r in records}),
        "lines.jsonl": "".join(json.dumps(r) + "\n" for r in records),
        "one-line keyed.json": json.dumps({r["instance_id"]: r for r in records}) + "\n",
    }
    for name, text in forms.items():
        (tmp_path / name).write_text(text)
        problems: list[str] = []
        assert [p.instance_id for p in load_predictions(tmp_path / name, problems)] == ["a__b-0", "a__b-1", "a__b-2"]
        assert problems == []


@pytest.mark.parametrize("ending", ["\n", ""])
def test_a_jsonl_file_of_one_line_is_one_prediction(tmp_path, ending):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"instance_id": "a__b-1", "model_patch": "", "model_name_or_path": "m"}) + ending)
    problems: list[str] = []
    assert [p.instance_id for p in load_predictions(path, problems)] == ["a__b-1"]
    assert problems == []


def test_bad_prediction_records_cost_only_themselves_with_one_line_each(tmp_path):
    good = {"instance_id": "a__b-1", "model_patch": None, "model_name_or_path": "m"}
    lines = [good, {"instance_id": "a__b-2"}, [1, 2], {**good, "instance_id": "../etc"}, {**good, "model_patch": 7},
             {**good, "instance_id": "a__b-3", "model_name_or_path": "../up"}]  # fmt: skip
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "{not json\n")
    problems: list[str] = []
    assert [p.instance_id for p in load_predictions(path, problems)] == ["a__b-1"]
    assert len(problems) == 6
    assert "missing field(s) ['model_patch', 'model_name_or_path']" in problems[0]
    assert "line 7: not valid JSON" in problems[-1]


def test_a_task_file_with_bad_records_loads_the_rest_when_asked(tmp_path):
    good = [json.loads(line) for line in (SUITE_DIR / "held_out.jsonl").read_text().splitlines()[:2]]
    for record in good:
        record["repo_path"] = str(SUITE_DIR / record["repo_path"])
    broken = {k: v for k, v in good[1].items() if k != "test_patch"} | {"instance_id": "x__y-1"}
    nowhere = {**good[1], "instance_id": "x__y-2", "repo_path": "no/such/repo.bundle"}
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good[0], broken, nowhere, good[1])))
    problems: list[str] = []
    assert [t.instance_id for t in load_tasks(path, problems)] == [good[0]["instance_id"], good[1]["instance_id"]]
    assert len(problems) == 2
    assert "missing field(s) ['test_patch']" in problems[0] and "does not exist" in problems[1]
    with pytest.raises(ValueError, match="missing field"):
        load_tasks(path)


# --- in Docker ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grader(base_image) -> DockerGrader:
    return DockerGrader(DockerGraderConfig(image=base_image, test_timeout_s=120, memory_mb=1024))


@pytest.mark.docker
def test_every_shipped_task_resolves_with_its_gold_patch_and_not_with_the_empty_one(grader):
    tasks = load_suite("all")
    jobs = [(t, patch) for t in tasks for patch in (t.patch, "")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        evaluations = list(pool.map(lambda job: grader(*job), jobs))
    wrong = []
    for (t, patch), e in zip(jobs, evaluations, strict=True):
        if e.resolved != bool(patch) or e.problem is not None:
            which = f"{t.instance_id} {'gold' if patch else 'empty'}"
            wrong.append(f"{which}: {e.grade} {e.problem}; the log ends {e.log[-600:]!r}")
        if swebench_resolved(t, e.log, patch) != e.resolved:
            wrong.append(f"{t.instance_id}: the swebench package disagrees")
    assert wrong == [], "\n".join(wrong)
    assert len(jobs) == 2 * len(tasks) >= 60


@pytest.mark.docker
def test_a_patch_that_hangs_the_tests_times_out_and_does_not_resolve(grader, task, tmp_path):
    repo = materialize_repo(task, tmp_path / "repo")
    source = repo / patch_files(task.patch)[0]
    source.write_text(source.read_text() + "\nimport time\ntime.sleep(3600)\n")
    hang = subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout
    e = DockerGrader(replace(grader.config, test_timeout_s=3), None)(task, hang)
    assert e.applied and not e.resolved
    assert e.problem == "the tests timed out"
    assert swebench_resolved(task, e.log, hang) is False


@pytest.mark.docker
def test_tests_that_ignore_sigterm_are_killed_and_logged_as_timed_out(grader, task, tmp_path):
    repo = materialize_repo(task, tmp_path / "repo")
    source = repo / patch_files(task.patch)[0]
    source.write_text(source.read_text() + "\nimport signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "time.sleep(3600)\n")  # fmt: skip
    stubborn = subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout
    e = DockerGrader(replace(grader.config, test_timeout_s=2), None)(task, stubborn)
    assert f"{TEST_EXIT_CODE}: 137" in e.log  # SIGKILLed by `timeout -k` after the SIGTERM it ignored
    assert TESTS_TIMEOUT in e.log
    assert e.problem == "the tests timed out"
    assert swebench_resolved(task, e.log, stubborn) is False


@pytest.mark.docker
def test_a_task_whose_test_patch_does_not_apply_cannot_be_graded(grader, task):
    stale = "diff --git a/t/gone.py b/t/gone.py\n--- a/t/gone.py\n+++ b/t/gone.py\n@@ -1 +1 @@\n-x\n+y\n"
    broken = replace(task, test_patch=stale)  # edits a file the base commit does not have
    with pytest.raises(GradingError, match="test patch does not apply"):
        grader(broken, task.patch)


def _eval(tmp_path: Path, tasks: Path, predictions: list[dict], *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in predictions))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "swebench_env", "eval", "--tasks", str(tasks), "--predictions", str(path),
            "--out", str(tmp_path / "out"), "--run-id", "r1", "--jobs", "2", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


@pytest.mark.docker
def test_eval_writes_swebench_reports_that_swebench_summarises_the_same_way(tmp_path, base_image):
    from swebench.harness.reporting import make_run_report

    held_out = load_suite("held_out")
    patches = [[t.patch, "", None, held_out[0].patch][i % 4] for i, t in enumerate(held_out)]  # gold/empty/none/wrong
    predictions = [{"instance_id": t.instance_id, "model_name_or_path": "org/model", "model_patch": patch}
                   for t, patch in zip(held_out, patches, strict=True)]  # fmt: skip
    done = _eval(tmp_path, SUITE_DIR / "held_out.jsonl", predictions, "--image", base_image)
    assert done.returncode in (0, 1), done.stderr
    ours = json.loads((tmp_path / "out" / "org__model.r1.json").read_text())
    assert ours["grader_disagreements"] == []
    assert set(ours["resolved_ids"]) == {t.instance_id for i, t in enumerate(held_out) if i % 4 == 0}
    assert set(ours["empty_patch_ids"]) == {t.instance_id for i, t in enumerate(held_out) if i % 4 in (1, 2)}
    report = json.loads((tmp_path / "out/r1/org__model" / held_out[0].instance_id / "report.json").read_text())
    assert report[held_out[0].instance_id]["tests_status"]["FAIL_TO_PASS"]["success"] == list(held_out[0].FAIL_TO_PASS)
    # SWE-bench's own summariser reads our folder (it looks under ./logs/run_evaluation) and agrees
    logs = tmp_path / "logs" / "run_evaluation"
    logs.mkdir(parents=True)
    (logs / "r1").symlink_to(tmp_path / "out" / "r1")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        theirs = json.loads(make_run_report({p["instance_id"]: p for p in predictions},
                                            [t.to_dict() for t in held_out], "r1").read_text())  # fmt: skip
    finally:
        os.chdir(cwd)
    for key in ("completed_ids", "resolved_ids", "unresolved_ids", "empty_patch_ids", "error_ids", "incomplete_ids"):
        assert theirs[key] == ours[key], key


@pytest.mark.docker
def test_eval_grades_the_rest_of_a_batch_around_bad_input(tmp_path, base_image):
    held_out = load_suite("held_out")[:3]
    records = [json.loads(line) for line in (SUITE_DIR / "held_out.jsonl").read_text().splitlines()[:3]]
    for record in records:
        record["repo_path"] = str(SUITE_DIR / record["repo_path"])
    missing = {k: v for k, v in records[2].items() if k != "FAIL_TO_PASS"} | {"instance_id": "bad__missing-1"}
    no_repo = {**records[2], "instance_id": "bad__norepo-1", "base_commit": "0" * 40}  # not in that repository
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in (*records, missing, no_repo)))
    predictions = [
        {"instance_id": held_out[0].instance_id, "model_patch": held_out[0].patch, "model_name_or_path": "m"},
        {"instance_id": held_out[1].instance_id, "model_patch": "please fix it", "model_name_or_path": "m"},
        {"instance_id": "bad__unknown-1", "model_patch": held_out[0].patch, "model_name_or_path": "m"},
        {"instance_id": "bad__norepo-1", "model_patch": held_out[0].patch, "model_name_or_path": "m"},
        {"instance_id": held_out[2].instance_id, "model_patch": held_out[2].patch, "model_name_or_path": "m"},
    ]
    done = _eval(tmp_path, tasks, predictions, "--image", base_image)
    assert done.returncode == 1, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert len(said) == 4, done.stderr
    assert any("missing field(s) ['FAIL_TO_PASS']" in line for line in said)
    assert any("unknown instance 'bad__unknown-1'" in line for line in said)
    assert any("is not a unified diff" in line for line in said)
    assert any("bad__norepo-1" in line and "cannot be checked out" in line for line in said)
    summary = json.loads((tmp_path / "out" / "m.r1.json").read_text())
    assert summary["resolved_ids"] == sorted([held_out[0].instance_id, held_out[2].instance_id])
    assert summary["error_ids"] == sorted([held_out[1].instance_id, "bad__norepo-1"])
    assert "Traceback" not in done.stderr
