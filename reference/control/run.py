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
                     out: Path, offset: int = 0, adopted=()) -> float:  # fmt: skip
    """Run the policy to its last step; returns the wall time of the run (held-out evaluations excluded).
    `offset`: steps trained before (a resumed run); `adopted`: finished groups no kept step trained."""
    driver: Driver | None = None

    def finished(group) -> None:
        driver.post(ev.GroupFinished(group.group_id, group.min_version - offset))

    rcfg = RolloutConfig(cfg.rollout.group_size, cfg.rollout.max_concurrency, cfg.rollout.temperature)
    async with RolloutManager(task, m.url, rcfg, f"run{time.time_ns()}", cfg.run.seed, finished, token) as rollout:
        rollout.adopt(adopted)
        metrics.held_out(offset, {**await rollout.evaluate(task.held_out(), "start"), "time_s": 0.0})
        sink = _Sink(metrics, bar)
        every, steps = cfg.run.eval_every_steps, cfg.policy.num_steps

        def evaluate(version: int):  # the weights of every `every`-th step, but the last (evaluated below)
            if every and version % every == 0 and version < steps:
                return cfg.task.name, cfg.task.options, cfg.run.seed * 1_000_003 + version
            return None

        executor = RuntimeExecutor(m.manager, rollout, workers, recorder, policy.trainers, out / "weights", sink,
                                   offset, evaluate)  # fmt: skip
        every_checkpoint = cfg.run.checkpoint_every_steps  # --resume starts engines from a checkpoint's version
        executor.keep_version = lambda v: v == 0 or bool(every_checkpoint and v % every_checkpoint == 0)
        driver = Driver(policy, executor, recorder, Deadlines())
        executor.attach(driver.post)
        metrics.clock_zero_epoch_s = time.time() - executor.now()
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
                                syncs=len(executor.sync_s), requests=rollout.requests,
                                engine_restarts=m.manager.supervisor.restarts)  # fmt: skip
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
    """Where a finished step's metrics go: metrics.jsonl and the progress bar."""

    def __init__(self, metrics, bar) -> None:
        self.metrics, self.bar = metrics, bar

    def step(self, record: dict, held_out: dict | None) -> None:
        self.metrics.step(record)
        if held_out is not None:
            self.metrics.held_out(record["step"] + 1, {**held_out, "time_s": record["time_s"]})
        self.bar.update(record)
