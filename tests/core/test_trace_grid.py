"""The Chrome trace of real simulated runs: slice times on a whole-microsecond grid, so consecutive slices
on one track never overlap, and slices that touch in the timeline touch in the trace."""

from __future__ import annotations

from collections import defaultdict

import pytest

from core.tags import Phase
from core.trace import to_chrome_trace

POLICIES = ["tag", "colocated"]  # the two with most switches and syncs (and most rounding overlaps before)


def tracks(trace: dict) -> dict[tuple[int, int], list[dict]]:
    """The complete ("X") events of each (pid, tid) track, in the file's order."""
    by_track = defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            by_track[(event["pid"], event["tid"])].append(event)
    return by_track


@pytest.mark.parametrize("policy", POLICIES)
def test_times_are_whole_microseconds(run_small, policy):
    spans = [e for track in tracks(to_chrome_trace(run_small(policy))).values() for e in track]
    assert spans
    assert all(type(e["ts"]) is int for e in spans)
    assert all(type(e["dur"]) is int for e in spans)
    assert min(e["dur"] for e in spans) >= 0


@pytest.mark.parametrize("policy", POLICIES)
def test_consecutive_slices_on_a_track_never_overlap(run_small, policy):
    by_track = tracks(to_chrome_trace(run_small(policy)))
    assert len(by_track) == 17  # 16 resources and the trainer steps
    overlaps = [
        (track, a["name"], a["ts"] + a["dur"], b["name"], b["ts"])
        for track, events in by_track.items()
        for a, b in zip(events, events[1:], strict=False)
        if a["ts"] + a["dur"] > b["ts"]
    ]
    assert overlaps == []


def back_to_back(timeline) -> list[tuple]:
    """Pairs of busy intervals of one resource where the second starts the moment the first ends."""
    rows = defaultdict(list)
    for iv in timeline.intervals:
        rows[iv.resource].append(iv)
    return [
        (a, b)
        for intervals in rows.values()
        for a, b in zip(intervals, intervals[1:], strict=False)
        if a.end_s == b.start_s and Phase.IDLE not in (a.phase, b.phase)
    ]


@pytest.mark.parametrize("policy", POLICIES)
def test_slices_that_touch_in_the_timeline_touch_in_the_trace(run_small, policy):
    timeline = run_small(policy)
    trace = to_chrome_trace(timeline)
    track = {e["args"]["name"]: (e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    spans = [e for events in tracks(trace).values() for e in events]
    ends = {(e["pid"], e["tid"], e["ts"] + e["dur"]) for e in spans}
    starts = {(e["pid"], e["tid"], e["ts"]) for e in spans}
    pairs = back_to_back(timeline)
    assert pairs  # the run has back-to-back busy slices (rollout -> switch -> train ...)
    for a, b in pairs:
        where = (*track[a.resource], round(a.end_s * 1e6))
        assert where in ends, (a, b)
        assert where in starts, (a, b)
