"""The asynchronous part of a training run, on the trajectory manager's event loop: the rollout manager, the
runtime executor and `core.driver`, until the policy's last step; plus the watcher that records when each
rollout resource generates and when it idles, on the run's one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from core import events as ev
from core.driver import Deadlines, Driver
from core.tags import Phase
from core.timeline import TimelineRecorder
from reference.control.executor import RuntimeExecutor
from reference.rollout.groups import RolloutConfig, RolloutManager

WATCH_INTERVAL_S = 0.02  # how often the rollout/idle phases are sampled


async def run_policy(cfg, task, policy, workers, m, recorder: TimelineRecorder, metrics, bar, token: str,
                     out: Path) -> float:  # fmt: skip
    """Run the policy to its last step; returns the wall time of the run (held-out evaluations excluded)."""
    driver: Driver | None = None

    def finished(group) -> None:
        driver.post(ev.GroupFinished(group.group_id, group.min_version))

    rcfg = RolloutConfig(cfg.rollout.group_size, cfg.rollout.max_concurrency, cfg.rollout.temperature)
    async with RolloutManager(task, m.url, rcfg, f"run{time.time_ns()}", cfg.run.seed, finished, token) as rollout:
        metrics.held_out(0, {**await rollout.evaluate(task.held_out(), "start"), "time_s": 0.0})
        sink = _Sink(metrics, bar, rollout, task, cfg.run.eval_every_steps, cfg.policy.num_steps)
        executor = RuntimeExecutor(m.manager, rollout, workers, recorder, policy.trainers, out / "weights", sink)
        driver = Driver(policy, executor, recorder, Deadlines())
        executor.attach(driver.post)
        sink.clock = executor.now
        watcher = asyncio.create_task(watch_phases(m.manager, recorder, policy, executor.now))
        try:
            await _until_done(driver, executor, cfg.run.time_limit_s)
        finally:
            wall = executor.now()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await executor.close()
        await _all_serving(m.manager)  # the last held-out evaluation may use every engine
        metrics.held_out(cfg.policy.num_steps, {**await rollout.evaluate(task.held_out(), "end"), "time_s": wall})
        metrics.counters.update(sync_s_mean=sum(executor.sync_s) / max(1, len(executor.sync_s)),
                                syncs=len(executor.sync_s), requests=rollout.requests)  # fmt: skip
    return wall


async def _all_serving(manager) -> None:
    for slot in manager.router.slots:
        manager.set_serving(slot.name, True)
    await manager.resume()


async def _until_done(driver: Driver, executor: RuntimeExecutor, time_limit_s: float) -> None:
    """The driver until the policy is done; a failure in the executor's work ends the run with its error."""
    run = asyncio.create_task(driver.run_async(timeout_s=time_limit_s))
    try:
        while not run.done():
            await asyncio.wait({run}, timeout=0.2)
            if (failure := executor.failure) is not None:
                raise failure
        run.result()
    finally:
        run.cancel()


async def watch_phases(manager, recorder: TimelineRecorder, policy, now) -> None:
    """Record each serving engine's resource as `rollout` while it has requests and is not paused, else `idle`.
    Switch, sync and train intervals are recorded by the driver and the executor; they are left alone. The
    tokens each engine generated since the last look go to its resource's open interval."""
    seen = {slot.name: slot.tokens for slot in manager.router.slots}
    while True:
        t = now()
        for slot in manager.router.slots:
            if slot.tokens > seen[slot.name]:
                recorder.add_tokens(slot.name, slot.tokens - seen[slot.name])
                seen[slot.name] = slot.tokens
            phase = recorder.phase(slot.name)
            if phase not in (Phase.ROLLOUT, Phase.IDLE):
                continue
            busy = slot.serving and slot.in_flight > 0 and not slot.paused
            want = Phase.ROLLOUT if busy else Phase.IDLE
            if want is not phase:
                recorder.set(slot.name, want, t, slot.version if busy else policy.step)
        await asyncio.sleep(WATCH_INTERVAL_S)


class _Sink:
    """Where a finished step's metrics go: metrics.jsonl, the progress bar, a periodic held-out evaluation."""

    def __init__(self, metrics, bar, rollout: RolloutManager, task, every: int, steps: int) -> None:
        self.metrics, self.bar, self.rollout, self.task = metrics, bar, rollout, task
        self.every, self.steps = every, steps
        self.clock = time.monotonic
        self._evals: set[asyncio.Task] = set()

    def step(self, record: dict) -> None:
        self.metrics.step(record)
        self.bar.update(record)
        done = record["step"] + 1
        if self.every and done % self.every == 0 and done < self.steps:
            task = asyncio.get_running_loop().create_task(self._evaluate(done))
            self._evals.add(task)
            task.add_done_callback(self._evals.discard)

    async def _evaluate(self, step: int) -> None:
        started = self.clock()
        result = await self.rollout.evaluate(self.task.held_out(), f"step{step}")
        self.metrics.held_out(step, {**result, "time_s": started})
