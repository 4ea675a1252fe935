"""Keeping engines serving: health probes, restarts with backoff, and bringing engines to the fleet's state.

Every `interval_s` the supervisor probes each engine (a short `health` call, or `stats` for in-process
engines). An engine that misses `probes_to_hold` probes in a row is held down (no request is routed to
it), so a frozen engine costs new sessions nothing; requests already on it continue elsewhere when its
stream stalls or breaks. An engine whose process died, that stays unresponsive for `restart_after_s`,
or that failed `restart_after_failures` requests in a row, is restarted (when the supervisor owns its
process), at most once per backoff period (1 s, doubling to `max_backoff_s`).

An engine that is back, restarted or not, first gets the state the control plane gave it: paused or not,
its weights (`update_weights(version, source)`: a restarted engine starts from its initial weights),
and only then serves again. This also covers engines that missed a pause or a weight update while down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from reference.engine.base import EngineError
from reference.manager.router import EngineSlot

log = logging.getLogger(__name__)


class EngineHandle(Protocol):
    """What the supervisor needs of an engine process it may restart (`reference.engine.process.EngineProcess`)."""

    url: str

    def alive(self) -> bool: ...

    def restart(self) -> None: ...


@dataclass(frozen=True)
class SupervisorConfig:
    interval_s: float = 2.0
    probe_timeout_s: float = 5.0
    probes_to_hold: int = 2  # missed probes in a row before an engine is held down
    restart_after_s: float = 30.0  # unresponsive this long: restart (when the process is ours)
    restart_after_failures: int = 3  # failed requests in a row: restart
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.probe_timeout_s > 0 and self.probes_to_hold >= 1):
            raise ValueError(f"bad supervisor timing: {self}")


@dataclass
class _Watch:
    missed: int = 0
    unresponsive_since: float | None = None
    next_restart_at: float = 0.0
    backoff_s: float = 1.0
    busy: bool = False  # a restart or sync is under way


class Supervisor:
    def __init__(
        self, manager: Any, processes: dict[str, EngineHandle] | None = None, config: SupervisorConfig | None = None
    ) -> None:
        self.manager, self.processes = manager, dict(processes or {})
        self.config = config or SupervisorConfig()
        self._watch = {s.name: _Watch() for s in manager.router.slots}
        self._task: asyncio.Task | None = None
        self._restarts: set[asyncio.Task] = set()
        self.restarts = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        for task in (self._task, *self._restarts):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._task, *self._restarts) if t is not None), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.gather(*(self._check(s) for s in self.manager.router.slots if not self._watch[s.name].busy))
            await asyncio.sleep(self.config.interval_s)

    async def _check(self, slot: EngineSlot) -> None:
        w, router, now = self._watch[slot.name], self.manager.router, time.monotonic()
        proc = self.processes.get(slot.name)
        if proc is not None and not proc.alive():
            router.hold_down(slot, "its process exited")
            self._restart(slot, proc, "its process exited")
            return
        if await self._probe(slot):
            w.missed, w.unresponsive_since = 0, None
            if proc is not None and slot.failures_in_a_row >= self.config.restart_after_failures:
                self._restart(slot, proc, f"{slot.failures_in_a_row} failed requests in a row")
            elif slot.stale or slot.held_down is not None:
                await self._sync(slot)
            return
        w.missed += 1
        w.unresponsive_since = w.unresponsive_since or now
        if w.missed >= self.config.probes_to_hold:
            router.hold_down(slot, f"not answering health probes for {now - w.unresponsive_since:.0f} s")
            slot.stale = True
        if proc is not None and now - w.unresponsive_since >= self.config.restart_after_s:
            self._restart(slot, proc, "unresponsive")

    async def _probe(self, slot: EngineSlot) -> bool:
        health = getattr(slot.engine, "health", None)
        try:
            async with asyncio.timeout(self.config.probe_timeout_s):
                return bool(await health()) if health is not None else bool(await slot.engine.stats())
        except (EngineError, TimeoutError, OSError):
            return False

    def _restart(self, slot: EngineSlot, proc: EngineHandle, why: str) -> None:
        """Start restarting the engine in the background (at most once per backoff period)."""
        w, now = self._watch[slot.name], time.monotonic()
        if w.busy or now < w.next_restart_at:
            return
        w.busy, w.next_restart_at = True, now + w.backoff_s
        w.backoff_s = min(self.config.max_backoff_s, 2 * w.backoff_s)
        self.manager.router.hold_down(slot, f"restarting ({why})")
        slot.stale = True
        task = asyncio.create_task(self._do_restart(slot, proc, why))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _do_restart(self, slot: EngineSlot, proc: EngineHandle, why: str) -> None:
        w = self._watch[slot.name]
        log.warning("restarting engine %s: %s", slot.name, why)
        slot.restarts += 1  # restarts begun: a run that ends while one is under way still counts it
        self.restarts += 1
        try:
            await asyncio.to_thread(proc.restart)
            if hasattr(slot.engine, "base_url"):
                slot.engine.base_url = proc.url
            w.missed, w.unresponsive_since = 0, None
            await self._sync(slot, reload=True)
        except Exception as e:  # noqa: BLE001 - a failed restart is retried after the backoff
            log.error("engine %s did not restart: %s", slot.name, e)
            self.manager.router.hold_down(slot, f"restart failed: {e}")
        finally:
            w.busy = False

    async def _sync(self, slot: EngineSlot, reload: bool = False) -> None:
        """Bring an engine that answers to the fleet's state, then let it serve; `reload`: it lost its weights
        (restarted), so load the fleet's checkpoint even if its version label matches."""
        m, engine = self.manager, slot.engine
        try:
            async with m.control, asyncio.timeout(max(60.0, self.config.probe_timeout_s)):
                stats = await engine.stats()
                if stats.version != slot.version or (reload and slot.weights_source is not None):
                    if not stats.paused:
                        await engine.pause()
                    await engine.update_weights(slot.version, slot.weights_source)
                    stats = await engine.stats()
                if slot.paused and not stats.paused:
                    await engine.pause()
                elif not slot.paused and stats.paused:
                    await engine.resume()
        except (EngineError, TimeoutError, ValueError, RuntimeError) as e:
            log.warning("engine %s could not be brought to the fleet's state: %s", slot.name, e)
            self.manager.router.hold_down(slot, f"could not sync: {e}")
            return
        slot.stale = False
        self.manager.router.bring_up(slot)
        self._watch[slot.name].backoff_s = 1.0
        log.info("engine %s is up (version %d%s)", slot.name, slot.version, ", paused" if slot.paused else "")
