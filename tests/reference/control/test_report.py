"""The run's report of a task evaluated problem by problem: instances.csv and the end-of-run table."""

from __future__ import annotations

import csv

from reference.control.report import MetricsLog, instance_rows, instance_table, write_instances


def _log(tmp_path) -> MetricsLog:
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    metrics.held_out(0, {"label": "start", "time_s": 0.0, "instances": {"h1": [0.0, 4]},
                         "train_instances": {"t1": [1.0, 4], "t2": [0.0, 4]}})  # fmt: skip
    metrics.held_out(4, {"label": "v4", "time_s": 9.0, "instances": {"h1": [0.0, 4]},
                         "train_instances": {"t1": [2.0, 4], "t2": [0.0, 3]}})  # fmt: skip
    metrics.held_out(8, {"label": "end", "time_s": 20.0, "instances": {"h1": [1.0, 4]},
                         "train_instances": {"t1": [3.0, 4], "t2": [0.0, 0]}})  # fmt: skip
    return metrics


def test_each_problem_has_its_pass_at_1_at_every_evaluation(tmp_path):
    labels, rows = instance_rows(_log(tmp_path))
    assert labels == ["start", "v4", "end"]
    assert [(split, pid) for split, pid, _ in rows] == [("train", "t1"), ("train", "t2"), ("held-out", "h1")]
    write_instances(labels, rows, tmp_path / "instances.csv")
    with (tmp_path / "instances.csv").open() as f:
        table = list(csv.DictReader(f))
    assert table[0]["start pass@1"] == "0.25" and table[0]["end pass@1"] == "0.75" and table[0]["v4 episodes"] == "4"
    assert table[1]["end pass@1"] == "" and table[1]["end episodes"] == ""  # no episode of t2 had a verdict


def test_the_end_of_run_table_compares_start_and_end(tmp_path):
    text = instance_table(_log(tmp_path))
    assert "t1" in text and "0.25 (1/4)" in text and "0.75 (3/4)" in text
    assert "train: pass@1 0.250 -> 0.750 over 1 problems (1 up, 0 down)" in text  # t2 has no verdict at the end
    assert "held-out: pass@1 0.000 -> 0.250 over 1 problems (1 up, 0 down)" in text


def test_no_table_without_per_problem_evaluations(tmp_path):
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    metrics.held_out(0, {"label": "start", "time_s": 0.0, "reward_mean": 0.5})
    assert instance_rows(metrics) == ([], [])
    assert instance_table(metrics) == ""
