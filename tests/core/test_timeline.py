"""Tests for core.timeline: the record reads back equal to what was written, bad records are refused
naming what is wrong, and every time is seconds since the run started."""

from __future__ import annotations

import json

import pytest

from core.metrics import summarize
from core.tags import Phase, Resource, SandboxPhase, Tag
from core.timeline import Interval, SandboxInterval, StepRecord, Timeline, TimelineRecorder


def make_timeline() -> Timeline:
    intervals = [
        Interval("R00", ("rollout",), "rollout", Phase.ROLLOUT, 0.0, 1.25, 0, 300, 4),
        Interval("R00", ("rollout",), "rollout", Phase.SYNC, 1.25, 1.5, 1, 0, 4),
        Interval("R00", ("rollout",), "rollout", Phase.ROLLOUT, 1.5, 3.1, 1, 512, 4),
        Interval("T00", ("rollout", "train"), "train", Phase.SWITCH, 0.0, 0.1, 0, 0, 4),
        Interval("T00", ("rollout", "train"), "train", Phase.TRAIN, 0.1, 1.25, 0, 900, 4),
        Interval("T00", ("rollout", "train"), "train", Phase.IDLE, 1.25, 3.1, 1, 0, 4),
    ]
    steps = [StepRecord(0, 0.1, 1.25, 900, 700, {0: 650, 1: 50}, 16)]
    sandboxes = [
        SandboxInterval("sandbox-0", SandboxPhase.START, 0.0, 0.5, "g0-e0"),
        SandboxInterval("sandbox-0", SandboxPhase.MODEL, 0.5, 1.0, "g0-e0"),
        SandboxInterval("sandbox-0", SandboxPhase.TOOL, 1.0, 1.1, "g0-e0"),
        SandboxInterval("sandbox-1", SandboxPhase.TEST_RUN, 1.1, 2.0, "g0-e0"),
    ]
    return Timeline(intervals, steps, 3.1, {"policy": "tag", "seed": 0}, {"wasted_tokens": 12, "ratio": 0.1 + 0.2},
                    sandboxes)  # fmt: skip


def test_a_timeline_reads_back_equal_through_json(tmp_path):
    timeline = make_timeline()
    again = Timeline.from_dict(json.loads(json.dumps(timeline.to_dict())))
    assert again == timeline
    assert again.steps[0].lag_tokens == {0: 650, 1: 50}  # integer lags again, not JSON's strings
    assert summarize(again) == summarize(timeline)
    path = tmp_path / "deep" / "intervals.json"
    timeline.save(path)
    assert Timeline.load(path) == timeline


def test_the_saved_record_names_its_format_and_time_base_and_is_repeatable(tmp_path):
    make_timeline().save(tmp_path / "a.json")
    make_timeline().save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    data = json.loads((tmp_path / "a.json").read_text())
    assert (data["format"], data["format_version"]) == ("seamlessflow-timeline", 2)
    assert data["time_base"] == "seconds since the run started"
    assert data["intervals"][0] == make_timeline().intervals[0].as_dict()


def test_records_of_another_format_are_refused():
    with pytest.raises(ValueError, match=r"not a timeline record .* format 'chrome', version None"):
        Timeline.from_dict({"format": "chrome", "traceEvents": []})


def test_a_record_with_missing_or_unknown_keys_is_refused_naming_them():
    data = make_timeline().to_dict()
    del data["intervals"][0]["tokens"]
    data["intervals"][0]["colour"] = "red"
    with pytest.raises(ValueError, match=r"interval record .*: missing keys \['tokens'\], unknown keys \['colour'\]"):
        Timeline.from_dict(data)
    data = make_timeline().to_dict()
    del data["steps"][0]["samples"]  # has a default: older records without it still read
    assert Timeline.from_dict(data).steps[0].samples == 0


@pytest.mark.parametrize(("index", "start_s", "end_s"), [(0, -0.5, 1.25), (5, 1.25, 3.5), (1, 1.5, 1.25)])
def test_times_outside_the_run_are_refused(index, start_s, end_s):
    data = make_timeline().to_dict()
    data["intervals"][index].update(start_s=start_s, end_s=end_s)
    with pytest.raises(ValueError, match=r"does not lie within \[0, wall_s=3.1\] in seconds since the run started"):
        Timeline.from_dict(data)


def test_the_recorder_refuses_a_time_before_the_run_started():
    recorder = TimelineRecorder([Resource("R00", frozenset({Tag.ROLLOUT}), 1)], {"R00": "rollout"})
    with pytest.raises(ValueError, match=r"R00: time -2.0 s is before the run started"):
        recorder.set("R00", Phase.ROLLOUT, -2.0, 0)


def test_sandbox_lanes_read_back_and_leave_the_metrics_alone():
    timeline = make_timeline()
    again = Timeline.from_dict(json.loads(json.dumps(timeline.to_dict())))
    assert again.sandboxes == timeline.sandboxes
    assert again.sandboxes[3].phase is SandboxPhase.TEST_RUN
    without = Timeline(timeline.intervals, timeline.steps, timeline.wall_s, timeline.meta, timeline.counters)
    assert summarize(timeline) == summarize(without)


def test_a_version_1_record_still_reads_with_no_sandbox_lanes():
    data = make_timeline().to_dict()
    data["format_version"] = 1
    del data["sandboxes"]
    timeline = Timeline.from_dict(data)
    assert timeline.sandboxes == []
    assert timeline.intervals == make_timeline().intervals


def test_a_newer_version_is_refused_naming_the_versions_read():
    data = {**make_timeline().to_dict(), "format_version": 3}
    with pytest.raises(ValueError, match=r"version 1 or 2: format 'seamlessflow-timeline', version 3"):
        Timeline.from_dict(data)


def test_a_sandbox_interval_outside_the_run_is_refused():
    data = make_timeline().to_dict()
    data["sandboxes"][0]["end_s"] = 4.0
    with pytest.raises(ValueError, match=r"sandbox .* does not lie within \[0, wall_s=3.1\]"):
        Timeline.from_dict(data)
    data["sandboxes"][0].update(end_s=0.5, phase="lunch")
    with pytest.raises(ValueError, match="'lunch' is not a valid SandboxPhase"):
        Timeline.from_dict(data)


def test_the_recorder_sorts_sandbox_lanes_naturally_and_clips_them_to_the_run():
    recorder = TimelineRecorder([], {})
    for lane, start, end in [("sandbox-10", 0.0, 1.0), ("sandbox-2", 2.0, 9.0), ("sandbox-2", 0.5, 1.5),
                             ("sandbox-3", 6.0, 7.0)]:  # fmt: skip
        recorder.add_sandbox(SandboxInterval(lane, SandboxPhase.TOOL, start, end))
    timeline = recorder.finish(5.0, {}, {})
    assert [(sb.lane, sb.start_s, sb.end_s) for sb in timeline.sandboxes] == [
        ("sandbox-2", 0.5, 1.5),
        ("sandbox-2", 2.0, 5.0),  # ended after the run: clipped
        ("sandbox-10", 0.0, 1.0),
    ]  # sandbox-3 began after the run ended: left out
    with pytest.raises(ValueError, match="not in seconds since the run started"):
        recorder.add_sandbox(SandboxInterval("sandbox-0", SandboxPhase.TOOL, -1.0, 1.0))
