"""Which engine serves a request: least loaded, with session affinity, skipping engines that failed.

Affinity keeps a session's turns on one engine as long as that engine is not more than
`affinity_slack` requests busier than the least loaded one, so the engine's prefix cache (the
built-in engine's, or vLLM's automatic prefix caching) still holds the session's history.
An engine that failed is skipped for `cooldown_s`, then tried again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from reference.engine.base import InferenceEngine


@dataclass
class EngineSlot:
    name: str
    engine: InferenceEngine
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    down_until: float = 0.0


class NoEngineAvailable(RuntimeError):
    pass


class Router:
    def __init__(self, engines: dict[str, InferenceEngine], affinity_slack: int = 2, cooldown_s: float = 5.0):
        if not engines:
            raise ValueError("the router needs at least one engine")
        self.slots = [EngineSlot(name, engine) for name, engine in engines.items()]
        self.affinity_slack, self.cooldown_s = affinity_slack, cooldown_s
        self._affinity: dict[str, EngineSlot] = {}

    def choose(self, session_id: str, exclude: set[str] = frozenset()) -> EngineSlot:
        now = time.monotonic()
        candidates = [s for s in self.slots if s.name not in exclude and s.down_until <= now]
        if not candidates:
            raise NoEngineAvailable(f"no engine available ({len(self.slots)} configured, all failed or excluded)")
        least = min(candidates, key=lambda s: (s.in_flight, s.served))
        sticky = self._affinity.get(session_id)
        if sticky in candidates and sticky.in_flight <= least.in_flight + self.affinity_slack:
            return sticky
        self._affinity[session_id] = least
        return least

    def acquire(self, slot: EngineSlot) -> None:
        slot.in_flight += 1
        slot.served += 1

    def release(self, slot: EngineSlot) -> None:
        slot.in_flight -= 1

    def mark_failed(self, slot: EngineSlot) -> None:
        slot.failures += 1
        slot.down_until = time.monotonic() + self.cooldown_s

    def stats(self) -> list[dict]:
        now = time.monotonic()
        return [
            {"name": s.name, "in_flight": s.in_flight, "served": s.served, "failures": s.failures,
             "up": s.down_until <= now}
            for s in self.slots
        ]  # fmt: skip
