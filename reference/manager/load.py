"""How busy the manager's event loop is: the signal that decides when to shed load.

A concurrency cap alone cannot tell a manager whose requests wait on slow engines (thousands in flight,
the loop idle: admit more) from one whose own CPU is the bottleneck (every new request slows all the
others until clients time out and the server works only for requests nobody waits for). The loop's lag
tells them apart: a timer that should fire every `interval_s` fires late by however long the loop took
to get back to it. While the recent lag is above a limit, new agent requests are refused with a 429
before their body is read, which keeps the requests already admitted fast.
"""

from __future__ import annotations

import asyncio
import contextlib


class LoopLag:
    """Measures the event loop's lag in a background task; `lag_s` is a smoothed recent value."""

    def __init__(self, interval_s: float = 0.05, smoothing: float = 0.5) -> None:
        if not (interval_s > 0 and 0 < smoothing <= 1):
            raise ValueError(f"interval_s must be > 0 and smoothing in (0, 1], got {interval_s}, {smoothing}")
        self.interval_s, self.smoothing = interval_s, smoothing
        self.lag_s = 0.0
        self.max_lag_s = 0.0  # the largest single sample since start
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(self.interval_s)
            sample = max(0.0, loop.time() - start - self.interval_s)
            self.max_lag_s = max(self.max_lag_s, sample)
            self.lag_s += self.smoothing * (sample - self.lag_s)
