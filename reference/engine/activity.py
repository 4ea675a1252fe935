"""An engine's activity as timeline intervals, in the record both executors share (core/timeline.py).

Phases: `rollout` while the engine steps (a new interval whenever the batch size or the policy
version changes, so a batch that thins out shows as a paler bar in `core.plot`), `sync` while it is
paused for a weight update, `idle` otherwise. Times are seconds since the engine started, on its
own monotonic clock. The log keeps the most recent `max_intervals` intervals.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from core.tags import Phase, Resource, Tag
from core.timeline import TimelineRecorder


class ActivityLog:
    def __init__(self, name: str = "engine", clock: Callable[[], float] = time.monotonic, max_intervals: int = 100_000):
        self.name, self.max_intervals = name, max_intervals
        self._clock, self._t0 = clock, clock()
        self._recorder = TimelineRecorder([Resource(name, frozenset({Tag.ROLLOUT}), 1)], {name: Tag.ROLLOUT.value})
        self._key: tuple[Phase, int, int] = (Phase.IDLE, 0, 0)

    def now_s(self) -> float:
        return self._clock() - self._t0

    def mark(self, phase: Phase, batch: int, version: int) -> None:
        """The engine is now in `phase`, with `batch` running requests, sampling with `version`."""
        key = (phase, batch if phase is Phase.ROLLOUT else 0, version)
        if key == self._key:
            return
        self._key = key
        self._recorder.set(self.name, phase, self.now_s(), version)
        if len(self._recorder.intervals) > self.max_intervals:
            del self._recorder.intervals[: self.max_intervals // 2]

    def add_tokens(self, tokens: int) -> None:
        self._recorder.add_tokens(self.name, tokens)

    def snapshot(self) -> dict:
        """{"now_s", "intervals": [Interval.as_dict(), ...]} up to now (the open interval is closed here
        and a new one of the same phase opened)."""
        phase, _, version = self._key
        now = self.now_s()
        self._recorder.set(self.name, phase, now, version)
        return {"now_s": now, "intervals": [iv.as_dict() for iv in self._recorder.intervals]}
