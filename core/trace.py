"""Export a timeline as Chrome / Perfetto trace JSON (open it at ui.perfetto.dev).

One process per pool (named by its capability tags), one thread per resource, one complete ("X")
event per busy interval; idle stretches are left out, since the gaps already show them. A last
process, "trainer steps", carries one event per training step; where the run had sandbox lanes (an agent
task's containers), a process "sandboxes" carries one thread per lane and one event per sandbox interval
(start, spare, model, tool, test_run). Times are whole microseconds, so
slices that touch on a track neither overlap nor leave a gap. Ids are assigned from sorted names
and events are sorted, so identical timelines give byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.metrics import natural_key, pool_of, resources_by_pool
from core.tags import Phase
from core.timeline import StepRecord, Timeline

STEPS_PROCESS = "trainer steps"
SANDBOX_PROCESS = "sandboxes"


def _us(seconds: float) -> int:
    """Trace timestamps are microseconds, here whole ones."""
    return round(seconds * 1e6)


def _span(start_s: float, end_s: float) -> dict:
    """ts and dur on an integer grid, from the rounded start and end: where one slice ends at the very
    time the next on its track starts, ts + dur of the first equals ts of the second. (A duration
    rounded on its own, as before, could reach a nanosecond into the next slice.)"""
    ts = _us(start_s)
    return {"ts": ts, "dur": _us(end_s) - ts}


def _meta_event(kind: str, pid: int, tid: int, name: str) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _sort_index_event(pid: int) -> dict:
    return {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}


def _track_ids(timeline: Timeline) -> tuple[dict[str, int], dict[str, int], list[dict]]:
    """pid per pool, tid per resource (numbered from 1 within its pool), and their naming events."""
    pids: dict[str, int] = {}
    tids: dict[str, int] = {}
    events: list[dict] = []
    for pid, (pool, resources) in enumerate(resources_by_pool(timeline).items(), start=1):
        pids[pool] = pid
        events.append(_meta_event("process_name", pid, 0, pool))
        events.append(_sort_index_event(pid))
        for tid, resource in enumerate(resources, start=1):
            tids[resource] = tid
            events.append(_meta_event("thread_name", pid, tid, resource))
    return pids, tids, events


def _interval_events(timeline: Timeline, pids: dict[str, int], tids: dict[str, int]) -> list[dict]:
    events = []
    for iv in timeline.intervals:
        if iv.phase is Phase.IDLE:
            continue
        events.append(
            {
                "name": iv.phase.value,
                "cat": iv.phase.value,
                "ph": "X",
                "pid": pids[pool_of(iv)],
                "tid": tids[iv.resource],
                **_span(iv.start_s, iv.end_s),
                "args": {"step": iv.step, "tokens": iv.tokens, "active": iv.active, "devices": iv.devices},
            }
        )
    return events


def _step_event(step: StepRecord, pid: int) -> dict:
    lag_tokens = {str(lag): step.lag_tokens[lag] for lag in sorted(step.lag_tokens)}
    return {
        "name": f"step {step.step}",
        "cat": "step",
        "ph": "X",
        "pid": pid,
        "tid": 1,
        **_span(step.start_s, step.end_s),
        "args": {"step": step.step, "tokens": step.tokens, "lag_tokens": lag_tokens},
    }


def _sandbox_events(timeline: Timeline, pid: int) -> tuple[list[dict], list[dict]]:
    """(naming events, one X event per sandbox interval) of the sandbox lanes, one thread per lane."""
    lanes = sorted({sb.lane for sb in timeline.sandboxes}, key=natural_key)
    tids = {lane: tid for tid, lane in enumerate(lanes, start=1)}
    meta = [_meta_event("process_name", pid, 0, SANDBOX_PROCESS), _sort_index_event(pid)]
    meta += [_meta_event("thread_name", pid, tid, lane) for lane, tid in tids.items()]
    spans = [
        {
            "name": sb.phase.value,
            "cat": "sandbox",
            "ph": "X",
            "pid": pid,
            "tid": tids[sb.lane],
            **_span(sb.start_s, sb.end_s),
            "args": {"session": sb.session},
        }
        for sb in timeline.sandboxes
    ]
    return meta, spans


def _sort_key(event: dict) -> tuple:
    return (event["pid"], event["tid"], event.get("ts", -1.0), event.get("dur", 0.0), event["name"])


def to_chrome_trace(timeline: Timeline) -> dict:
    """The trace as a dict: naming ("M") events first, then complete ("X") events by track and time."""
    pids, tids, meta_events = _track_ids(timeline)
    steps_pid = len(pids) + 1
    meta_events.append(_meta_event("process_name", steps_pid, 0, STEPS_PROCESS))
    meta_events.append(_sort_index_event(steps_pid))
    meta_events.append(_meta_event("thread_name", steps_pid, 1, "steps"))
    spans = _interval_events(timeline, pids, tids) + [_step_event(s, steps_pid) for s in timeline.steps]
    if timeline.sandboxes:
        sandbox_meta, sandbox_spans = _sandbox_events(timeline, steps_pid + 1)
        meta_events += sandbox_meta
        spans += sandbox_spans
    return {
        "traceEvents": meta_events + sorted(spans, key=_sort_key),
        "displayTimeUnit": "ms",
        "metadata": dict(timeline.meta),
    }


def write_chrome_trace(timeline: Timeline, path: str | Path) -> None:
    """Write the trace as JSON with sorted keys, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        json.dump(to_chrome_trace(timeline), f, sort_keys=True)
