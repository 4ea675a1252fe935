"""Which engine serves a request: least loaded, with session affinity, skipping engines that are down.

Affinity keeps a session's turns on one engine as long as that engine is not more than
`affinity_slack` requests busier than the least loaded one, so the engine's prefix cache (the
built-in engine's, or vLLM's automatic prefix caching) still holds the session's history.

An engine that fails a request (it died, dropped the stream, or stalled) is skipped for a cooldown
that doubles with each failure in a row (`cooldown_s`, 2x, 4x ... up to `max_cooldown_s`) and resets
when it next completes a request, so a frozen engine costs new sessions one stall, not one per cooldown.
The supervisor may also hold an engine down (dead, restarting) until it says otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from reference.engine.base import InferenceEngine


@dataclass
class EngineSlot:
    name: str
    engine: InferenceEngine
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    failures_in_a_row: int = 0
    down_until: float = 0.0
    held_down: str | None = None  # why the supervisor holds it down (dead, restarting), or None
    stale: bool = False  # missed a control call (pause, weights): unusable until the supervisor syncs it
    last_error: str | None = None
    restarts: int = 0
    # What the control plane wants of this engine (a restarted engine is brought back to it):
    serving: bool = True  # takes new requests (False: its resource trains, or it is being preempted)
    paused_since: float | None = None  # paused (partial rollout) since this monotonic time
    version: int = 0  # the policy version of its weights
    weights_source: str | None = None  # the checkpoint it last loaded (None: its initial weights)
    calls: set[str] = field(default_factory=set)  # engine request ids running on it now
    tokens: int = 0  # tokens it generated for the manager's requests, ever

    @property
    def paused(self) -> bool:
        return self.paused_since is not None

    def up(self, now: float) -> bool:
        return self.held_down is None and not self.stale and self.down_until <= now


class NoEngineAvailable(RuntimeError):
    pass


class Router:
    def __init__(
        self,
        engines: dict[str, InferenceEngine],
        affinity_slack: int = 2,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 300.0,
    ):
        if not engines:
            raise ValueError("the router needs at least one engine")
        self.slots = [EngineSlot(name, engine) for name, engine in engines.items()]
        self.affinity_slack, self.cooldown_s, self.max_cooldown_s = affinity_slack, cooldown_s, max_cooldown_s
        self._affinity: dict[str, EngineSlot] = {}

    def slot(self, name: str) -> EngineSlot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"no engine {name!r}; engines: {', '.join(s.name for s in self.slots)}")

    def choose(self, session_id: str, exclude: set[str] = frozenset()) -> EngineSlot:
        now = time.monotonic()
        candidates = [s for s in self.slots if s.name not in exclude and s.serving and s.up(now)]
        if not candidates:
            serving = sum(s.serving for s in self.slots)
            raise NoEngineAvailable(
                f"no engine available ({len(self.slots)} configured, {serving} serving; the "
                f"others failed, are excluded or do not serve now)"
            )
        least = min(candidates, key=lambda s: (s.in_flight, s.served))
        sticky = self._affinity.get(session_id)
        if sticky in candidates and sticky.in_flight <= least.in_flight + self.affinity_slack:
            return sticky
        if len(self._affinity) > 4 * 10_000:  # forget old sessions' affinity; it is only a hint
            self._affinity.clear()
        self._affinity[session_id] = least
        return least

    def acquire(self, slot: EngineSlot) -> None:
        slot.in_flight += 1
        slot.served += 1

    def release(self, slot: EngineSlot) -> None:
        slot.in_flight -= 1

    def mark_ok(self, slot: EngineSlot) -> None:
        slot.failures_in_a_row = 0

    def mark_failed(self, slot: EngineSlot, error: str = "") -> None:
        slot.failures += 1
        slot.failures_in_a_row += 1
        slot.last_error = error or slot.last_error
        backoff = min(self.max_cooldown_s, self.cooldown_s * 2 ** min(slot.failures_in_a_row - 1, 30))
        slot.down_until = time.monotonic() + backoff

    def hold_down(self, slot: EngineSlot, reason: str) -> None:
        slot.held_down = reason

    def bring_up(self, slot: EngineSlot) -> None:
        slot.held_down, slot.down_until, slot.failures_in_a_row = None, 0.0, 0

    def stats(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "name": s.name,
                "in_flight": s.in_flight,
                "served": s.served,
                "failures": s.failures,
                "failures_in_a_row": s.failures_in_a_row,
                "up": s.up(now),
                "restarts": s.restarts,
                "serving": s.serving,
                "paused": s.paused,
                "version": s.version,
                "down_for_s": None if s.up(now) or s.held_down else round(s.down_until - now, 3),
                "reason": s.held_down or (None if s.up(now) else "missed a control call" if s.stale else s.last_error),
            }
            for s in self.slots
        ]
