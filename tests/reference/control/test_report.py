"""The run's report: of a task evaluated problem by problem, instances.csv and the end-of-run table; of a long
run, the window its timeline.png shows."""

from __future__ import annotations

import csv
import json

from core.tags import Phase, SandboxPhase
from core.timeline import Interval, SandboxInterval, StepRecord, Timeline
from reference.control.report import MetricsLog, instance_rows, instance_table, steady_window, write_instances


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


def test_a_step_with_no_trained_token_is_written_with_nulls(tmp_path):
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    metrics.step({"step": 0, "loss": float("nan"), "staleness": {"ratio": [float("inf"), 1.0]}})
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["loss"] is None and line["staleness"] == {"ratio": [None, 1.0]}


def test_a_long_runs_picture_window_keeps_its_sandbox_lanes_clipped_at_the_runs_times():
    steps = [StepRecord(i, 10.0 * i, 10.0 * i + 9, 100, 50, {0: 50}, 4) for i in range(30)]
    sandboxes = [SandboxInterval("sandbox-0", SandboxPhase.TOOL, 5.0, 6.0),  # before the window
                 SandboxInterval("sandbox-1", SandboxPhase.TEST_RUN, 95.0, 105.0),  # across its start (99 s)
                 SandboxInterval("sandbox-0", SandboxPhase.TOOL, 150.0, 151.0)]  # fmt: skip
    timeline = Timeline([], steps, 300.0, {}, {}, sandboxes)
    window, start_s, note = steady_window(timeline)
    assert note == ": steps 10-19 of 30"
    assert (start_s, window.wall_s) == (steps[9].end_s, steps[19].end_s)  # from step 9's end to step 19's: 99-199 s
    assert [(sb.lane, sb.start_s, sb.end_s) for sb in window.sandboxes] == [
        ("sandbox-1", 99.0, 105.0), ("sandbox-0", 150.0, 151.0)]  # fmt: skip


def test_a_long_runs_picture_shows_the_runs_own_times_and_its_numbers(tmp_path):
    """The window of a 30-step run starts at 100 s: so does the drawn axis, and the title gives the whole run's
    throughput and each pool's idle share."""
    from core.metrics import summarize
    from reference.control.report import draw_run_timeline

    steps = [StepRecord(i, 10.0 * i, 10.0 * i + 10, 100, 50, {0: 50}, 4) for i in range(30)]
    intervals = [
        Interval("R00", ("rollout",), "rollout", Phase.ROLLOUT, 0.0, 150.0, 0, 900, 1),
        Interval("R00", ("rollout",), "rollout", Phase.IDLE, 150.0, 300.0, 0, 0, 1),
        Interval("T00", ("rollout", "train"), "train", Phase.TRAIN, 0.0, 300.0, 0, 0, 1),
    ]
    timeline = Timeline(intervals, steps, 300.0, {"policy": "tag", "workload": "math", "clock": "measured"})
    summary = summarize(timeline)
    fig = draw_run_timeline(timeline, summary, tmp_path / "timeline.png")
    ax = fig.axes[0]
    assert ax.get_xlim() == (100.0, 200.0)  # step 9 ends at 100 s, step 19 at 200 s
    assert ax.get_xlabel() == "wall-clock time since the run started (s)"
    assert ax.get_title() == (
        "tag (measured), math, 2 resources: steps 10-19 of 30\n"
        "the whole run: 10 trained-sequence tok/s  ·  mean step 10 s  ·  idle 25%: rollout pool 50%, "
        "rollout + train pool 0%"
    )
