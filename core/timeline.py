"""The timeline record both executors write, a recorder that builds it, and its JSON form.

One `Interval` per busy or idle stretch of each resource, covering [0, wall_s] with no gaps, plus
one `StepRecord` per training step. Every time is in seconds since the run started (one time base
for every interval and step). Every metric is computed from this record by
`core.metrics.summarize`, so the simulator and the real runtime are scored identically.
`Timeline.save` and `Timeline.load` write and read the whole record back (`intervals.json` beside a
simulation's `summary.json`); the Chrome trace (`core.trace`) is a one-way view of it.

Sandbox lanes: an agent task's containers are not resources (no devices, no tags, no phase a policy
decides), so what they did is kept apart, as `SandboxInterval`s on lanes (`sandbox-0`, `sandbox-1`, ...,
one container at a time each), on the same time base. Metrics never read them; a lane need not be
covered from 0 to wall_s. The simulator writes none.

Format versions: a reader reads every version up to its own (`READABLE_VERSIONS`); a version only adds
keys, so an older record reads as the newer one with those keys empty. Version 1: intervals and steps;
version 2 adds `sandboxes`.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from core.tags import Phase, Resource, SandboxPhase

FORMAT = "seamlessflow-timeline"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # see "Format versions" above
TIME_BASE = "seconds since the run started"
TOLERANCE_S = 1e-6  # how far past wall_s an interval or step may end (float rounding)


def _check_keys(kind: str, data: dict, cls) -> None:
    """Raise ValueError naming missing or unknown keys of a record read back from JSON."""
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing, unknown = sorted(required - data.keys()), sorted(data.keys() - names)
    if missing or unknown:
        raise ValueError(f"{kind} record {data!r}: missing keys {missing}, unknown keys {unknown}")


@dataclass(frozen=True)
class Interval:
    """What one resource did from `start_s` to `end_s`.

    step: for train, the training step; for rollout and sync, the policy version being run or
        loaded; for switch and idle, the training step in progress or next.
    tokens: tokens generated (rollout) or this resource's share of tokens trained (train).
    """

    resource: str
    tags: tuple[str, ...]
    active: str
    phase: Phase
    start_s: float
    end_s: float
    step: int
    tokens: int
    devices: int

    def as_dict(self) -> dict:
        return {
            "resource": self.resource,
            "tags": list(self.tags),
            "active": self.active,
            "phase": self.phase.value,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "step": self.step,
            "tokens": self.tokens,
            "devices": self.devices,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Interval:
        """The inverse of `as_dict`."""
        _check_keys("interval", data, cls)
        return cls(**{**data, "tags": tuple(data["tags"]), "phase": Phase(data["phase"])})


@dataclass(frozen=True)
class StepRecord:
    """One training step.

    tokens: every token trained (prompts and responses); generated_tokens: the responses only.
    samples: trajectories trained.
    lag_tokens: generated tokens trained, keyed by policy-version lag (step - producing version).
    """

    step: int
    start_s: float
    end_s: float
    tokens: int
    generated_tokens: int
    lag_tokens: dict[int, int]
    samples: int = 0  # trajectories trained

    def as_dict(self) -> dict:
        """JSON-ready: lags become string keys, in increasing order."""
        return {
            "step": self.step,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "tokens": self.tokens,
            "generated_tokens": self.generated_tokens,
            "lag_tokens": {str(lag): self.lag_tokens[lag] for lag in sorted(self.lag_tokens)},
            "samples": self.samples,
        }

    @classmethod
    def from_dict(cls, data: dict) -> StepRecord:
        """The inverse of `as_dict`."""
        _check_keys("step", data, cls)
        return cls(**{**data, "lag_tokens": {int(lag): n for lag, n in data["lag_tokens"].items()}})


@dataclass(frozen=True)
class SandboxInterval:
    """What one sandbox lane held from `start_s` to `end_s` (see "Sandbox lanes" above).

    session: the episode's session in the trajectory manager ("" for a container no episode used)."""

    lane: str
    phase: SandboxPhase
    start_s: float
    end_s: float
    session: str = ""

    def as_dict(self) -> dict:
        return {
            "lane": self.lane,
            "phase": self.phase.value,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "session": self.session,
        }

    @classmethod
    def from_dict(cls, data: dict) -> SandboxInterval:
        """The inverse of `as_dict`."""
        _check_keys("sandbox", data, cls)
        return cls(**{**data, "phase": SandboxPhase(data["phase"])})


@dataclass
class Timeline:
    """A finished run: intervals, steps, executor counters (e.g. wasted tokens), and sandbox lanes."""

    intervals: list[Interval]
    steps: list[StepRecord]
    wall_s: float
    meta: dict = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    sandboxes: list[SandboxInterval] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The whole record as JSON-ready data; `from_dict` gives an equal `Timeline` back."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "time_base": TIME_BASE,
            "wall_s": self.wall_s,
            "meta": dict(self.meta),
            "counters": dict(self.counters),
            "intervals": [iv.as_dict() for iv in self.intervals],
            "steps": [step.as_dict() for step in self.steps],
            "sandboxes": [sb.as_dict() for sb in self.sandboxes],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Timeline:
        """Read a record written by `to_dict` (any of `READABLE_VERSIONS`); raises ValueError for another format
        or version, or a time out of [0, wall_s]."""
        if data.get("format") != FORMAT or data.get("format_version") not in READABLE_VERSIONS:
            raise ValueError(
                f"not a timeline record of format {FORMAT!r} version {' or '.join(map(str, READABLE_VERSIONS))}: "
                f"format {data.get('format')!r}, version {data.get('format_version')!r}"
            )
        timeline = cls(
            [Interval.from_dict(d) for d in data["intervals"]],
            [StepRecord.from_dict(d) for d in data["steps"]],
            data["wall_s"],
            dict(data["meta"]),
            dict(data["counters"]),
            [SandboxInterval.from_dict(d) for d in data.get("sandboxes", [])],  # none before version 2
        )
        timeline.check_times()
        return timeline

    def check_times(self) -> None:
        """Raise ValueError unless every interval and step lies within [0, wall_s] (one time base)."""
        for kind, records in (("interval", self.intervals), ("step", self.steps), ("sandbox", self.sandboxes)):
            for r in records:
                if not 0.0 <= r.start_s <= r.end_s <= self.wall_s + TOLERANCE_S:
                    raise ValueError(f"{kind} {r!r} does not lie within [0, wall_s={self.wall_s}] in {TIME_BASE}")

    def save(self, path: str | Path) -> None:
        """Write the record as JSON (sorted keys: identical timelines give identical files)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            json.dump(self.to_dict(), f, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        with Path(path).open() as f:
            return cls.from_dict(json.load(f))


class TimelineRecorder:
    """Tracks each resource's current phase; closing a phase appends an interval.

    Times are seconds since the run started. Safe to call from several threads (a real-time
    executor's callbacks and the driver's control thread)."""

    def __init__(self, resources: list[Resource], active: dict[str, str]) -> None:
        self._res = {r.name: r for r in resources}
        self._active = dict(active)
        self._open: dict[str, tuple[Phase, float, int, int]] = {r.name: (Phase.IDLE, 0.0, 0, 0) for r in resources}
        self._lock = threading.Lock()
        self.intervals: list[Interval] = []
        self.steps: list[StepRecord] = []
        self.sandboxes: list[SandboxInterval] = []

    def phase(self, resource: str) -> Phase:
        return self._open[resource][0]

    def set(self, resource: str, phase: Phase, now: float, step: int, active: str | None = None) -> None:
        """Close `resource`'s open interval at `now` and open a new one."""
        if now < 0:
            raise ValueError(f"{resource}: time {now} s is before the run started (times are {TIME_BASE})")
        with self._lock:
            self._close(resource, now)
            if active is not None:
                self._active[resource] = active
            self._open[resource] = (phase, now, step, 0)

    def add_tokens(self, resource: str, tokens: int) -> None:
        with self._lock:
            phase, start, step, count = self._open[resource]
            self._open[resource] = (phase, start, step, count + tokens)

    def add_step(self, record: StepRecord) -> None:
        with self._lock:
            self.steps.append(record)

    def add_sandbox(self, interval: SandboxInterval) -> None:
        """A sandbox lane's interval (recorded after the fact, in the run's time base)."""
        if not 0.0 <= interval.start_s <= interval.end_s:
            raise ValueError(f"sandbox interval {interval!r} is not in {TIME_BASE} or ends before it starts")
        with self._lock:
            self.sandboxes.append(interval)

    def _close(self, resource: str, now: float) -> None:
        phase, start, step, tokens = self._open[resource]
        if now < start:
            raise ValueError(f"{resource}: interval would end at {now} before it starts at {start}")
        if now > start or tokens:
            r = self._res[resource]
            self.intervals.append(
                Interval(r.name, r.tag_names, self._active[resource], phase, start, now, step, tokens, r.devices)
            )

    def finish(self, now: float, meta: dict, counters: dict[str, float]) -> Timeline:
        with self._lock:
            for name in self._open:
                self._close(name, now)
            self._open = {name: (Phase.IDLE, now, 0, 0) for name in self._open}
            intervals = sorted(self.intervals, key=lambda i: (i.resource, i.start_s, i.end_s))
            sandboxes = sorted(
                (sb for sb in self.sandboxes if sb.start_s < now),
                key=lambda sb: (_lane_key(sb.lane), sb.start_s, sb.end_s),
            )
            sandboxes = [replace(sb, end_s=min(sb.end_s, now)) for sb in sandboxes]  # the run ended meanwhile
            return Timeline(intervals, list(self.steps), now, dict(meta), dict(counters), sandboxes)


def _lane_key(lane: str) -> tuple:
    """Lanes in natural order: "sandbox-2" before "sandbox-10"."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", lane))
