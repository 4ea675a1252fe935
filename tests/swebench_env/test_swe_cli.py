"""`python -m swebench_env`: user mistakes are one line on stderr and exit 2; Ctrl-C exits 130."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swebench_env import cli
from swebench_env.suite import SUITE_DIR


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_suite_needs_out_or_verify(capsys):
    code, _, err = run(capsys, "suite")
    assert code == 2
    assert err == "error: give either --out DIR (regenerate and verify) or --verify [--dir DIR]\n"


def test_verify_one_shipped_task(capsys):
    code, out, _ = run(capsys, "suite", "--verify", "--ids", "swesuite__wraptext-2", "--jobs", "1")
    assert code == 0
    assert out.startswith("verified 1 tasks in ")
    assert out.endswith(": 1 ok, 0 bad\n")


def test_verify_unknown_id_is_a_user_mistake(capsys):
    code, _, err = run(capsys, "suite", "--verify", "--ids", "nope-1")
    assert code == 2
    assert err.startswith("error: no task 'nope-1' in ")
    assert err.count("\n") == 1


def test_validate_reports_the_count_or_the_first_problem(capsys, tmp_path):
    code, out, _ = run(capsys, "validate", str(SUITE_DIR / "train.jsonl"))
    assert code == 0
    assert out.endswith("valid tasks\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instance_id": "x-1"}) + "\n")
    code, _, err = run(capsys, "validate", str(bad))
    assert code == 2
    assert err.startswith(f"error: {bad} line 1: instance 'x-1': missing field(s) ")
    assert err.count("\n") == 1


def test_validate_missing_file(capsys, tmp_path):
    code, _, err = run(capsys, "validate", str(tmp_path / "none.jsonl"))
    assert code == 2
    assert err == f"error: task file {tmp_path / 'none.jsonl'} does not exist\n"


def test_a_folder_given_as_a_file_is_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "validate", str(tmp_path))
    assert (code, err) == (2, f"error: task file {tmp_path} cannot be read: Is a directory\n")
    tasks = SUITE_DIR / "held_out.jsonl"
    code, _, err = run(
        capsys, "eval", "--tasks", str(tasks), "--predictions", str(tmp_path), "--out", str(tmp_path / "o")
    )
    assert (code, err) == (2, f"error: predictions file {tmp_path} cannot be read: Is a directory\n")
    assert not (tmp_path / "o").exists()


def test_check_runs_a_task_file_on_this_machine(capsys):
    tasks = str(SUITE_DIR / "held_out.jsonl")
    code, out, _ = run(capsys, "check", tasks, "--ids", "swesuite__statskit-4", "--sandbox", "local")
    assert code == 0
    assert out.startswith("verified 1 tasks in ")
    assert out.endswith(": 1 ok, 0 bad\n")


@pytest.mark.docker
def test_check_runs_a_task_file_in_its_sandbox_by_default(capsys):
    code, out, _ = run(capsys, "check", str(SUITE_DIR / "held_out.jsonl"), "--ids", "swesuite__statskit-4")
    assert code == 0
    assert out.startswith("verified 1 tasks in ")
    assert out.endswith(": 1 ok, 0 bad\n")


def test_check_names_a_broken_task_and_why_on_one_line(capsys, tmp_path):
    record = json.loads((SUITE_DIR / "held_out.jsonl").read_text().splitlines()[0])
    record["repo_path"] = str((SUITE_DIR / record["repo_path"]).resolve())
    record["PASS_TO_PASS"] = [*record["PASS_TO_PASS"], "tests/test_semver.py::test_not_there"]
    (tmp_path / "t.jsonl").write_text(json.dumps(record) + "\n")
    code, out, err = run(capsys, "check", str(tmp_path / "t.jsonl"), "--sandbox", "local")
    assert (code, out.endswith(": 0 ok, 1 bad\n")) == (1, True)
    assert err.startswith(
        f"{record['instance_id']}: PASS_TO_PASS tests fail at the base commit: ['tests/test_semver.py"
    )
    assert err.count("\n") == 2  # the empty patch, and the gold patch that does not resolve it


def test_checkout_writes_the_base_commit(capsys, tmp_path):
    code, out, _ = run(capsys, "checkout", str(SUITE_DIR / "train.jsonl"), "swesuite__lrucache-2", str(tmp_path / "r"))
    assert code == 0
    assert out == f"{tmp_path / 'r'}\n"
    assert (tmp_path / "r" / "lrucache.py").is_file()
    assert not (tmp_path / "r" / "tests" / "test_lrucache.py").read_text().count("def test_get_refreshes_recency")


def test_ctrl_c_exits_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "validate", interrupted)
    code, _, _ = run(capsys, "validate", "x")
    assert code == 130


def test_module_entry_point_runs():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "swebench_env", "--help"], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "suite" in done.stdout


def test_out_and_verify_together_is_a_user_mistake(capsys):
    code, _, err = run(capsys, "suite", "--out", "x", "--verify")
    assert code == 2
    assert err.startswith("error: give either --out DIR")


def test_argparse_mistakes_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["suite", "--jobs", "two"])
    assert stop.value.code == 2
