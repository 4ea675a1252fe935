"""Tests for core.trace: event counts, track names, microsecond units, determinism."""

from __future__ import annotations

import json
import random

from core.tags import Phase, SandboxPhase
from core.timeline import Interval, SandboxInterval, StepRecord, Timeline
from core.trace import to_chrome_trace, write_chrome_trace

R, T, S, W, I = Phase.ROLLOUT, Phase.TRAIN, Phase.SYNC, Phase.SWITCH, Phase.IDLE
POOLS = {"gen1": ("rollout",), "gen0": ("rollout",), "trn0": ("train",), "mix0": ("rollout", "train")}

# resource -> [(phase, start_s, end_s, step, tokens)]; each row tiles [0, 4].
LAYOUT = {
    "gen1": [(R, 0, 1.5, 0, 30), (S, 1.5, 2, 1, 0), (R, 2, 4, 1, 40)],
    "gen0": [(R, 0, 2, 0, 50), (I, 2, 2.25, 1, 0), (R, 2.25, 4, 1, 20)],
    "trn0": [(I, 0, 2, 0, 0), (T, 2, 3.5, 0, 500), (S, 3.5, 4, 1, 0)],
    "mix0": [(R, 0, 1, 0, 10), (W, 1, 1.000001, 0, 0), (T, 1.000001, 4, 0, 70)],
}
STEPS = [StepRecord(0, 2.0, 3.5, 500, 400, {1: 100, 0: 300})]


def make_timeline() -> Timeline:
    intervals = [
        Interval(res, POOLS[res], "x", phase, float(a), float(b), step, tokens, 8)
        for res, rows in LAYOUT.items()
        for phase, a, b, step, tokens in rows
    ]
    return Timeline(intervals, list(STEPS), 4.0, {"policy": "tag", "seed": 3})


def events(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def test_one_x_event_per_busy_interval_and_step():
    trace = to_chrome_trace(make_timeline())
    busy = sum(1 for rows in LAYOUT.values() for row in rows if row[0] is not I)
    xs = events(trace, "X")
    assert len(xs) == busy + len(STEPS) == 11
    assert all(e["name"] == e["cat"] for e in xs if not e["name"].startswith("step"))
    assert "idle" not in {e["name"] for e in xs}


def test_process_and_thread_names_sorted():
    trace = to_chrome_trace(make_timeline())
    meta = events(trace, "M")
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert procs == {1: "rollout", 2: "rollout+train", 3: "train", 4: "trainer steps"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads == {(1, 1): "gen0", (1, 2): "gen1", (2, 1): "mix0", (3, 1): "trn0", (4, 1): "steps"}


def test_units_are_microseconds_and_args():
    xs = events(to_chrome_trace(make_timeline()), "X")
    train = next(e for e in xs if e["pid"] == 3 and e["name"] == "train")
    assert (train["ts"], train["dur"]) == (2_000_000.0, 1_500_000.0)
    assert train["args"] == {"step": 0, "tokens": 500, "active": "x", "devices": 8}
    switch = next(e for e in xs if e["name"] == "switch")
    assert (switch["ts"], switch["dur"]) == (1_000_000.0, 1.0)
    step = next(e for e in xs if e["pid"] == 4)
    assert step["name"] == "step 0"
    assert (step["ts"], step["dur"]) == (2_000_000.0, 1_500_000.0)
    assert step["args"]["tokens"] == 500
    assert step["args"]["lag_tokens"] == {"0": 300, "1": 100}


def test_top_level_fields():
    trace = to_chrome_trace(make_timeline())
    assert trace["displayTimeUnit"] == "ms"
    assert trace["metadata"] == {"policy": "tag", "seed": 3}


def test_events_sorted_within_each_track():
    xs = events(to_chrome_trace(make_timeline()), "X")
    keys = [(e["pid"], e["tid"], e["ts"]) for e in xs]
    assert keys == sorted(keys)


def test_written_file_is_byte_identical(tmp_path):
    first, second, third = tmp_path / "a.json", tmp_path / "b" / "b.json", tmp_path / "c.json"
    write_chrome_trace(make_timeline(), first)
    write_chrome_trace(make_timeline(), second)
    shuffled = make_timeline()
    random.Random(0).shuffle(shuffled.intervals)
    write_chrome_trace(shuffled, third)
    assert first.read_bytes() == second.read_bytes() == third.read_bytes()
    assert json.loads(first.read_text()) == to_chrome_trace(make_timeline())


def test_sandbox_lanes_are_a_process_of_their_own_one_thread_a_lane():
    sandboxes = [
        SandboxInterval("sandbox-10", SandboxPhase.TOOL, 1.0, 1.25, "g0-e1"),
        SandboxInterval("sandbox-2", SandboxPhase.START, 0.0, 0.5, "g0-e0"),
        SandboxInterval("sandbox-2", SandboxPhase.TEST_RUN, 0.5, 2.0, "g0-e0"),
    ]
    timeline = make_timeline()
    timeline.sandboxes = sandboxes
    trace = to_chrome_trace(timeline)
    names = {e["pid"]: e["args"]["name"] for e in events(trace, "M") if e["name"] == "process_name"}
    (pid,) = [p for p, name in names.items() if name == "sandboxes"]
    threads = [e["args"]["name"] for e in events(trace, "M") if e["name"] == "thread_name" and e["pid"] == pid]
    assert threads == ["sandbox-2", "sandbox-10"]  # natural order
    spans = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in events(trace, "X") if e["pid"] == pid]
    assert spans == [(1, "start", 0, 500_000), (1, "test_run", 500_000, 1_500_000), (2, "tool", 1_000_000, 250_000)]


def test_a_run_without_sandboxes_has_no_sandbox_process():
    names = [e["args"]["name"] for e in events(to_chrome_trace(make_timeline()), "M") if e["name"] == "process_name"]
    assert "sandboxes" not in names
