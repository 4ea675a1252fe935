"""How busy the manager's event loop is: the signal that decides when to shed load.

A fixed concurrency cap cannot tell a manager whose requests wait on slow engines (thousands in flight,
the loop idle: admit more) from one whose own CPU is the bottleneck (every new request slows all the
others until clients time out and the server works only for requests nobody waits for). The loop's lag
tells them apart: a timer that should fire every `interval_s` fires late by however long the loop took
to get back to it. `AdaptiveLimit` turns the lag into an in-flight limit (additive increase,
multiplicative decrease, as TCP does with its window): while the loop lags more than the target, the
limit drops below what is in flight; while it keeps up and the limit is nearly used, the limit grows
back, up to the configured cap. Agent requests beyond the limit get a 429 before their body is read, so
the requests admitted stay fast even when refusing the rest takes much of the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc

# Python collects its youngest generation every 700 net allocations of container objects. A manager holds
# thousands of sessions in memory (about 70 tracked objects each: tree nodes, their arrays, chat caches),
# and requests in flight survive the frequent young collections, so they are promoted and soon force full
# collections that scan every session: at 10,000 sessions one takes about 0.2 s, during which the loop
# stands still. Under overload (2,400 requests/s offered, benchmarks/overload.py) the defaults spent about a
# quarter of the core collecting garbage, and goodput fell to half of the knee; with a young generation of
# 50,000 objects it held the knee.
GC_YOUNG_OBJECTS = 50_000


def tune_gc(young: int = GC_YOUNG_OBJECTS) -> tuple[int, int, int]:
    """Fewer, cheaper garbage collections for a long-running server process; returns the old thresholds.

    Freezes what exists now (modules, the tokenizer: never garbage, never scanned again) and collects the
    young generation every `young` net allocations, the middle one every 20 of those and everything every 10
    middle ones, so reference cycles are still freed (a session's tree holds none: it is freed when the session
    leaves memory). `young` 0
    leaves Python's defaults. Process-wide: the `serve` and `train` commands call it; a program that embeds
    the manager may."""
    if young < 0:
        raise ValueError(f"young must be >= 0 (0: Python's defaults), got {young}")
    old = gc.get_threshold()
    if young:
        gc.collect()
        gc.freeze()
        gc.set_threshold(young, 20, 10)
    return old


class LoopLag:
    """Measures the event loop's lag in a background task; `lag_s` is a smoothed recent value."""

    def __init__(self, interval_s: float = 0.05, smoothing: float = 0.5, on_sample=None) -> None:
        """`on_sample(lag_s)`: called with the smoothed lag after every sample."""
        if not (interval_s > 0 and 0 < smoothing <= 1):
            raise ValueError(f"interval_s must be > 0 and smoothing in (0, 1], got {interval_s}, {smoothing}")
        self.interval_s, self.smoothing = interval_s, smoothing
        self.lag_s = 0.0
        self.max_lag_s = 0.0  # the largest single sample since start
        self.on_sample = on_sample
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
            if self.on_sample is not None:
                self.on_sample(self.lag_s)


class AdaptiveLimit:
    """How many agent requests may be in flight: between `floor` and `cap`, driven by the loop's lag.

    A decrease cuts the limit to 70% of what is in flight (smoothed as the lag is: a lag that happens to be
    sampled just after a batch of requests finished must not drop it to the floor) and is not repeated for the
    next `hold` samples, while the requests it refuses drain: the lag is smoothed too, and cutting again on
    every sample of one slow stretch sent the limit down to a third and idled the manager between climbs."""

    def __init__(self, cap: int, target_lag_s: float, floor: int = 16, hold: int = 4) -> None:
        if cap < 0 or target_lag_s < 0 or floor < 1 or hold < 0:
            raise ValueError(
                f"cap and target_lag_s must be >= 0, floor >= 1 and hold >= 0, got {cap}, {target_lag_s}, {floor}, "
                f"{hold}"
            )
        self.cap = cap or 2**31  # 0: no fixed cap
        self.target_lag_s, self.floor, self.hold = target_lag_s, min(floor, self.cap), hold
        self.limit = self.cap
        self.in_flight = 0.0  # smoothed over the samples
        self._held = 0  # samples left before the limit may fall again

    def update(self, lag_s: float, in_flight: int) -> None:
        self.in_flight += 0.5 * (in_flight - self.in_flight)
        if self.target_lag_s and lag_s > self.target_lag_s:
            if self._held:
                self._held -= 1
                return
            self.limit = max(self.floor, int(min(self.limit, max(in_flight, self.in_flight)) * 0.7))
            self._held = self.hold
        else:
            self._held = 0
            if in_flight >= 0.8 * self.limit:
                self.limit = min(self.cap, self.limit + max(1, self.limit // 10))
