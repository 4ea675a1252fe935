"""A benchmark's bad number is argparse's one line and exit code 2, before anything starts: a zero or negative
count used to end in a traceback (an empty median, a division by zero) or run until stopped."""

from __future__ import annotations

import importlib
import sys

import pytest

CASES = [
    ("driver_overhead", ["--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    ("driver_overhead", ["--batch", "-1"], "argument --batch: must be an integer >= 1, got '-1'"),
    ("engine_throughput", ["--requests", "0"], "argument --requests: must be an integer >= 1, got '0'"),
    ("manager_memory", ["--turns", "0"], "argument --turns: must be an integer >= 1, got '0'"),
    ("manager_memory", ["--concurrency", "-1"], "argument --concurrency: must be an integer >= 1, got '-1'"),
    ("manager_memory", ["--budgets", "0,x"], "argument --budgets: each entry must be an integer >= 0, got 'x'"),
    ("manager_memory", ["--budgets", "0,,5"], "argument --budgets: expected comma-separated values, got '0,,5'"),
    ("prefix_tree", ["--reps", "2"], "argument --reps: must be an integer >= 3, got '2'"),
    ("swe_sandbox", ["--n", "0"], "argument --n: must be an integer >= 1, got '0'"),
    ("swe_sandbox", ["--grade-jobs", "0"], "argument --grade-jobs: must be an integer >= 1, got '0'"),
    ("train_speed", ["--steps", "-1"], "argument --steps: must be an integer >= 1, got '-1'"),
    ("weight_handoff", ["--versions", "0"], "argument --versions: must be an integer >= 1, got '0'"),
    ("overload", ["--rates", "400,0"], "argument --rates: each entry must be an integer >= 1, got '0'"),
    ("overload", ["--level-s", "0"], "argument --level-s: must be a number > 0, got '0'"),
    ("overload", ["--timeout-s", "nan"], "argument --timeout-s: must be a number > 0, got 'nan'"),
    ("proxy_overhead", ["--levels", "0"], "argument --levels: each entry must be an integer >= 1, got '0'"),
    ("proxy_overhead", ["--rounds", "0"], "argument --rounds: must be an integer >= 1, got '0'"),
]


@pytest.mark.parametrize(("module", "argv", "message"), CASES, ids=[f"{m}{a[0]}{a[1]}" for m, a, _ in CASES])
def test_a_bad_count_is_one_line_and_exit_2(module, argv, message, monkeypatch, capsys):
    main = importlib.import_module(f"benchmarks.{module}").main
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1] == f"{module}.py: error: {message}", err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "2"], "argument --target: must be a number in (0, 1], got '2'"),
        (["--max-seconds", "nan"], "argument --max-seconds: must be a number > 0, got 'nan'"),
        (["--max-steps", "0"], "argument --max-steps: must be an integer >= 1, got '0'"),
        (["--lag", "-1"], "argument --lag: must be an integer >= 0, got '-1'"),
        (["--eval-every", "0"], "argument --eval-every: must be an integer >= 1, got '0'"),
    ],
)
def test_the_learnability_probe_refuses_a_bad_number_in_one_line(argv, message, capsys):
    from reference.trainer.probe import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1].endswith(f"error: {message}"), err
