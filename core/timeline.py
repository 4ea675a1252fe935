"""The timeline record both executors write, and a recorder that builds it.

One `Interval` per busy or idle stretch of each resource, covering [0, wall_s] with no gaps, plus
one `StepRecord` per training step. Every metric is computed from this record by
`core.metrics.summarize`, so the simulator and the real runtime are scored identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.tags import Phase, Resource


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


@dataclass
class Timeline:
    """A finished run: intervals, steps, and executor counters (e.g. wasted tokens)."""

    intervals: list[Interval]
    steps: list[StepRecord]
    wall_s: float
    meta: dict = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)


class TimelineRecorder:
    """Tracks each resource's current phase; closing a phase appends an interval."""

    def __init__(self, resources: list[Resource], active: dict[str, str]) -> None:
        self._res = {r.name: r for r in resources}
        self._active = dict(active)
        self._open: dict[str, tuple[Phase, float, int, int]] = {r.name: (Phase.IDLE, 0.0, 0, 0) for r in resources}
        self.intervals: list[Interval] = []
        self.steps: list[StepRecord] = []

    def phase(self, resource: str) -> Phase:
        return self._open[resource][0]

    def set(self, resource: str, phase: Phase, now: float, step: int, active: str | None = None) -> None:
        """Close `resource`'s open interval at `now` and open a new one."""
        self._close(resource, now)
        if active is not None:
            self._active[resource] = active
        self._open[resource] = (phase, now, step, 0)

    def add_tokens(self, resource: str, tokens: int) -> None:
        phase, start, step, count = self._open[resource]
        self._open[resource] = (phase, start, step, count + tokens)

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
        for name in self._open:
            self._close(name, now)
        self._open = {name: (Phase.IDLE, now, 0, 0) for name in self._open}
        intervals = sorted(self.intervals, key=lambda i: (i.resource, i.start_s, i.end_s))
        return Timeline(intervals, list(self.steps), now, dict(meta), dict(counters))
