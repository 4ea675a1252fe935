"""Fleet control: partial rollout and placement, the control plane's hooks on the manager's engines.

Every call acts on the engines named (None: all of them). Each engine keeps its own state (serving,
paused, weights version), which the supervisor restores on an engine that comes back. A pause stops
generation at a token boundary and keeps every request; after `update_weights` and `resume` each unfinished
request re-prefills under the new weights. `preempt` moves an engine's requests to others with their tokens;
`restart_older_than` starts over the requests holding tokens too old to train on. A pause that is never
resumed ends after `max_pause_s` (a watchdog).

`FleetControl` is a base class of `TrajectoryManager`, so callers keep calling these on the manager; it
shares the calls in flight with `generation.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from reference.engine.base import EngineError, abort_all
from reference.manager.router import EngineSlot, Router

if TYPE_CHECKING:
    from reference.manager.config import ManagerConfig
    from reference.manager.generation import Progress

log = logging.getLogger(__name__)


class FleetControl:
    """The manager's control of its engines (see the module docstring)."""

    config: ManagerConfig
    router: Router
    control: asyncio.Lock  # serialises fleet state changes (pause, weights, resume, engine syncs)
    watchdog_resumes: int
    _watchdogs: set[asyncio.Task]
    _progress: dict[str, Progress]
    _migrating: set[str]
    _restarting: set[str]
    _serving_changed: asyncio.Event

    @property
    def version(self) -> int:
        """The newest policy version any engine holds."""
        return max(s.version for s in self.router.slots)

    @property
    def paused(self) -> bool:
        """Every engine is paused."""
        return all(s.paused for s in self.router.slots)

    def select(self, engines: Sequence[str] | None) -> list[EngineSlot]:
        """The slots of the engines named (None: all); ValueError naming an unknown one and the choices."""
        if engines is None:
            return list(self.router.slots)
        if isinstance(engines, str) or not engines:
            raise ValueError(f"engines must be a non-empty list of engine names, got {engines!r}")
        names = {s.name for s in self.router.slots}
        if unknown := [e for e in engines if e not in names]:
            raise ValueError(f"no engine {unknown[0]!r}; engines: {', '.join(sorted(names))}")
        return [s for s in self.router.slots if s.name in set(engines)]

    async def pause(self, engines: Sequence[str] | None = None) -> None:
        """Stop generation at a token boundary on these engines, keeping every request they run."""
        slots = self.select(engines)
        async with self.control:
            now = time.monotonic()
            for s in slots:
                s.paused_since = s.paused_since or now
            await self._broadcast(lambda e: e.pause(), slots)
        if self.config.max_pause_s:
            self._watchdogs.add(asyncio.create_task(self._pause_watchdog(slots, now, self.config.max_pause_s)))

    async def update_weights(
        self, version: int, source: str | Mapping[str, str] | None = None, engines: Sequence[str] | None = None
    ):
        """Load policy `version` (from checkpoint directory `source`, or the engine's own hand-off) onto
        these engines, which must be paused; tokens they sample from now on carry `version`. `source` may
        also map each engine's name to its own directory (a copy on its node that only it reads); each
        engine keeps its source, which a restarted engine is reloaded from."""
        slots = self.select(engines)
        if isinstance(source, Mapping):
            if missing := [s.name for s in slots if not isinstance(source.get(s.name), str)]:
                raise ValueError(f"update_weights: no source directory for engines {', '.join(missing)}")
            sources = {s.name: source[s.name] for s in slots}
        else:
            sources = {s.name: source for s in slots}
        async with self.control:
            by_engine = {id(s.engine): sources[s.name] for s in slots}
            if running := [s.name for s in slots if not s.paused]:
                raise RuntimeError(
                    f"update_weights needs paused engines; {', '.join(running)} not paused (POST /admin/pause first)"
                )
            await self._broadcast(lambda e: e.update_weights(version, by_engine[id(e)]), slots)
            for s in slots:
                s.version = version
                s.weights_source = sources[s.name] if sources[s.name] is not None else s.weights_source

    async def resume(self, engines: Sequence[str] | None = None) -> None:
        """Continue generation on these engines: each unfinished request re-prefills under their weights."""
        slots = self.select(engines)
        async with self.control:
            for s in slots:
                s.paused_since = None
            await self._broadcast(lambda e: e.resume(), slots)

    def set_serving(self, engine: str, serving: bool) -> None:
        """Whether `engine` takes new requests (the requests it runs are not affected; see `preempt`)."""
        (slot,) = self.select([engine])
        slot.serving = serving
        if serving:
            self._serving_changed.set()

    async def preempt(self, engine: str, timeout_s: float = 60.0) -> int:
        """Take `engine` out of service now: it takes no new request, and each request it runs continues on
        another engine from its prompt and the tokens it has so far (partial rollout; the agent only sees a
        slower answer). Returns how many requests moved; TimeoutError if some did not leave in time."""
        (slot,) = self.select([engine])
        slot.serving = False
        moved: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while slot.calls:
            fresh = slot.calls - moved
            moved |= fresh
            self._migrating |= fresh
            await abort_all(slot.engine, sorted(fresh))
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {engine}: {len(slot.calls)} requests did not move within {timeout_s} s")
            await asyncio.sleep(0.01)
        return len(moved)

    async def restart_older_than(self, min_version: int, engines: Sequence[str] | None = None) -> int:
        """Requests on these engines holding a token older than `min_version` start over from their prompt
        (their tokens could never be trained within the staleness bound). Only requests whose text has not
        reached the agent (non-streaming) are restarted. Returns how many were."""
        restarted = []
        for slot in self.select(engines):
            for call in list(slot.calls):
                p = self._progress.get(call)
                if p is not None and p.restartable and p.versions and min(p.versions) < min_version:
                    restarted.append((slot, call))
        self._restarting |= {call for _, call in restarted}
        for slot in {slot.name: slot for slot, _ in restarted}.values():
            await abort_all(slot.engine, [call for s, call in restarted if s is slot])
        return len(restarted)

    async def _pause_watchdog(self, slots: list[EngineSlot], since: float, after_s: float) -> None:
        try:
            await asyncio.sleep(after_s)
            stuck = [s.name for s in slots if s.paused_since is not None and s.paused_since <= since]
            if stuck:
                log.error(
                    "engines %s were paused for %g s without a resume (max_pause_s); resuming them",
                    ", ".join(stuck),
                    after_s,
                )
                self.watchdog_resumes += 1
                await self.resume(stuck)
        finally:
            self._watchdogs.discard(asyncio.current_task())

    async def _broadcast(self, call, slots: list[EngineSlot]) -> None:
        """Apply a control call to each of `slots` that is up. An engine that is down, or fails the call, is
        marked stale: no request goes to it until the supervisor has brought it to its state (paused or
        not, weights version). A refusal (ValueError: a bad source) is the caller's error and is raised.
        Callers hold `control`, which the supervisor also takes to sync an engine, so an engine never joins
        halfway through a pause / update / resume."""
        now = time.monotonic()
        up = [s for s in slots if s.up(now)]
        for s in slots:
            s.stale = s.stale or s not in up
        results = await asyncio.gather(*(call(s.engine) for s in up), return_exceptions=True)
        refusals = []
        for slot, result in zip(up, results, strict=True):
            if isinstance(result, EngineError | RuntimeError):  # failed, or not in its expected state: resync it
                log.warning("engine %s failed a control call: %s", slot.name, result)
                self.router.mark_failed(slot, str(result))
                slot.stale = True
            elif isinstance(result, BaseException):
                refusals.append(result)
        if refusals:
            raise refusals[0]
