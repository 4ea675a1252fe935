"""The asynchronous part of a training run, on the trajectory manager's event loop: the rollout manager, the
runtime executor and `core.driver`, until the policy's last step; plus the watcher that records when each
rollout resource generates and when it idles, on the run's one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core import events as ev
from core.driver import Deadlines, Driver
from core.tags import Phase
from core.timeline import TimelineRecorder
from reference.control.calls import WorkerGroup
from reference.control.executor import RuntimeExecutor
from reference.control.transport import ObjectStoreTransport, object_store_transport
from reference.rollout.groups import GroupResult, RolloutConfig, RolloutManager
from reference.tasks.base import SingleTurn

if TYPE_CHECKING:
    from core.policies import BasePolicy
    from reference.control.config import TrainConfig
    from reference.control.report import MetricsLog, Progress
    from reference.manager.embedded import ManagerThread
    from reference.tasks.base import Task

WATCH_INTERVAL_S = 0.02  # how often the rollout/idle phases are sampled


@dataclass(frozen=True)
class RunPlan:
    """What the run is: its config and task, where it writes, and where a resumed run starts."""

    cfg: TrainConfig
    task: Task
    out: Path  # the run's folder (published versions under out/weights)
    offset: int = 0  # steps trained before this run (a resumed run)
    adopted: tuple[GroupResult, ...] = ()  # finished groups no kept step trained (a resumed run's)


@dataclass(frozen=True)
class RunHandles:
    """The live parts the run drives."""

    policy: BasePolicy
    workers: WorkerGroup  # the resources' workers
    manager_thread: ManagerThread  # the embedded trajectory manager; the run runs on its event loop
    admin_token: str  # the manager's admin token (rewards and weights)


@dataclass(frozen=True)
class RunSinks:
    """Where the run reports: the timeline, metrics.jsonl and the progress bar."""

    recorder: TimelineRecorder
    metrics: MetricsLog
    progress: Progress


async def run_policy(*, plan: RunPlan, live: RunHandles, sinks: RunSinks) -> float:
    """Run the policy to its last step; returns the wall time of the run (held-out evaluations excluded)."""
    cfg, manager = plan.cfg, live.manager_thread.manager
    driver: Driver | None = None

    def finished(group) -> None:
        driver.post(ev.GroupFinished(group.group_id, group.min_version - plan.offset))

    rcfg = RolloutConfig(cfg.rollout.group_size, cfg.rollout.max_concurrency, cfg.rollout.temperature)
    session = f"run{time.time_ns()}"
    url, token = live.manager_thread.url, live.admin_token
    async with RolloutManager(plan.task, url, rcfg, session, cfg.run.seed, finished, token) as rollout:
        rollout.adopt(plan.adopted)
        if cfg.run.evaluate:
            start = await _held_out(plan, rollout, sinks.progress, "start")
            sinks.metrics.held_out(plan.offset, {**start, "label": "start", "time_s": 0.0})
        evaluations = Evaluations(cfg, plan.task, rollout, live.workers, live.policy.trainers, sinks.metrics)
        transport = await _transport(plan, live)
        executor = RuntimeExecutor(
            manager=manager,
            rollout=rollout,
            workers=live.workers,
            recorder=sinks.recorder,
            trainers=live.policy.trainers,
            weights_root=plan.out / "weights",
            sink=_Sink(sinks.metrics, sinks.progress),
            offset=plan.offset,
            evaluate=evaluations.of_version,
            transport=transport,
        )
        try:
            evaluations.now = executor.now
            every_checkpoint = cfg.run.checkpoint_every_steps  # --resume starts engines from a checkpoint's version
            executor.keep_version = lambda v: v == 0 or bool(every_checkpoint and v % every_checkpoint == 0)
            driver = Driver(live.policy, executor, sinks.recorder, Deadlines())
            executor.attach(driver.post)
            sinks.metrics.clock_zero_epoch_s = time.time() - executor.now()
            engines_before = await engine_counters(manager)
            watcher = asyncio.create_task(watch_phases(manager, sinks.recorder, live.policy, executor.now))
            try:
                await _until_done(driver, executor, cfg.run.time_limit_s)
            finally:
                wall = executor.now()
                watcher.cancel()  # before anything else awaits: the timeline ends at `wall`
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
                engines_after = await engine_counters(manager)
                await executor.close()
            await evaluations.finish()
            if cfg.run.evaluate:
                await _load_newest(manager, executor, executor.newest)  # the final weights, on every engine
                await _all_serving(manager)  # the last held-out evaluation may use every engine
                end = await _held_out(plan, rollout, sinks.progress, "end")
                versions = _engine_versions(manager)
                sinks.metrics.held_out(
                    cfg.policy.num_steps, {**end, "label": "end", "time_s": wall, "engine_versions": versions}
                )
            engines = {k: max(0, v - engines_before.get(k, 0)) for k, v in engines_after.items()}  # 0: one restarted
            _count(sinks.metrics, executor, rollout, manager, engines)
        finally:
            await executor.transport.close()  # copies still being made are abandoned
    return wall


async def _transport(plan: RunPlan, live: RunHandles) -> ObjectStoreTransport | None:
    """The run's weight transport (None: a directory under OUT/weights that every engine reads)."""
    if plan.cfg.engine.weights_transport != "object_store":
        return None
    return await object_store_transport(live.workers, live.manager_thread.manager, plan.offset)


async def _held_out(plan: RunPlan, rollout: RolloutManager, progress: Progress, label: str) -> dict:
    """The held-out evaluation at the `start` or the `end` of RL (`evaluate_splits`), noted on the progress bar."""
    run = plan.cfg.run
    progress.note(f"evaluating the weights {'before' if label == 'start' else 'after'} RL ({_per_problem(run)}) ...")
    result = await evaluate_splits(rollout, plan.task, label, run.eval_samples, run.held_out_samples)
    progress.note(evaluation_line(label, result))
    return result


def _count(metrics: MetricsLog, executor: RuntimeExecutor, rollout: RolloutManager, manager, engines: dict) -> None:
    """The run's counters: syncs, requests, engine restarts, restarted requests, the engines' own counts
    (`engines`: what they did during the run) and, with the object store, the mean copy time of a version."""
    metrics.counters.update(
        sync_s_mean=sum(executor.sync_s) / max(1, len(executor.sync_s)),
        syncs=len(executor.sync_s),
        requests=rollout.requests,
        engine_restarts=manager.supervisor.restarts,
        restarted_requests=executor.restarted + rollout.refreshed,
        **engines,
    )
    if stage_s := executor.transport.stage_s:  # copies to the engines' nodes (object_store)
        metrics.counters.update(weights_copy_s_mean=sum(stage_s) / len(stage_s))


ENGINE_COUNTERS = ("tokens_generated", "prefill_tokens", "reprefills")  # summed over engines, in a run's counters


async def engine_counters(manager) -> dict[str, int]:
    """The engines' own counts of `ENGINE_COUNTERS` (what they generated and prefilled, and the requests they
    prefilled again after a weight update), summed; an engine that cannot say (down, or a backend that does not
    count them) adds nothing, and a count no engine gives is left out."""
    totals: dict[str, int] = {}
    for slot in manager.router.slots:
        try:
            stats = await slot.engine.stats()
        except Exception:  # a counter is not worth failing a finished run for
            continue
        for key in ENGINE_COUNTERS:
            if isinstance(value := stats.extra.get(key), int):
                totals[key] = totals.get(key, 0) + value
    return totals


def _per_problem(run) -> str:
    """How many episodes an evaluation runs a problem, in words."""
    n, held = run.eval_samples, run.held_out_samples

    def episodes(k: int) -> str:
        return f"{k} episode{'' if k == 1 else 's'}"

    if held is None or held == n:
        return f"{episodes(n)} a problem"
    return f"{episodes(n)} a training problem, {episodes(held)} a held-out one"


def evaluation_line(label: str, result: dict) -> str:
    """`evaluate_splits`' result as one line: held-out (and train) pass@1."""
    train = f", train {result['train_exact_match']:.3f}" if "train_exact_match" in result else ""
    return f"evaluation {label}: held-out {result['exact_match']:.3f}{train} (exact match, mean over episodes)"


async def evaluate_splits(
    rollout: RolloutManager, task, label: str, samples: int = 1, held_out_samples: int | None = None
) -> dict:
    """`held_out_samples` (None: `samples`) episodes of each held-out problem (`reward_mean`, `exact_match`,
    ...), and `samples` of each training problem (`train_*`) where the task lists them (`train_problems`: pass@1
    on the train split), through the engines."""
    splits = {"": (task.held_out(), samples if held_out_samples is None else held_out_samples)}
    if hasattr(task, "train_problems"):
        splits["train_"] = (task.train_problems(), samples)
    results = await asyncio.gather(
        *(rollout.evaluate(problems, f"{label}-{prefix or 'held'}", n) for prefix, (problems, n) in splits.items())
    )
    return {f"{prefix}{k}": v for prefix, result in zip(splits, results, strict=True) for k, v in result.items()}


class Evaluations:
    """The held-out evaluations of every `run.eval_every_steps`-th version but the last (evaluated at the end).

    A single-turn task is evaluated by the first trainer shard in-process (its own sampler: it never competes
    with rollout for an engine; the step waits for it, as trainer work); under FSDP every shard runs the same
    evaluation, as each forward gathers the parameters from all of them. Any other task's episodes need the
    engines and its sandboxes: they run beside the rollout, the step does not wait, and each result is logged
    when it is in, with the policy versions its episodes were generated with."""

    def __init__(
        self, cfg, task, rollout: RolloutManager, workers: WorkerGroup, trainers: Sequence[str], metrics
    ) -> None:
        self.cfg, self.task, self.rollout, self.workers = cfg, task, rollout, workers
        self.trainers = list(trainers) if cfg.trainer_parallel.fsdp else list(trainers[:1])
        self.metrics = metrics
        self.now = lambda: 0.0
        self._pending: set[asyncio.Task] = set()

    async def of_version(self, version: int) -> dict | None:
        every, steps = self.cfg.run.eval_every_steps, self.cfg.policy.num_steps
        if not (self.cfg.run.evaluate and every and version % every == 0 and version < steps):
            return None
        if isinstance(self.task, SingleTurn):
            seed = self.cfg.run.seed * 1_000_003 + version
            options = self.cfg.task.options
            results = await asyncio.gather(
                *(
                    self.workers.trainer(t).evaluate(self.cfg.task.name, options, seed, self.cfg.rollout.temperature)
                    for t in self.trainers
                )
            )
            return results[0].to_metrics()
        task = asyncio.get_running_loop().create_task(self._in_background(version))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return None

    async def _in_background(self, version: int) -> None:
        run = self.cfg.run
        result = await evaluate_splits(self.rollout, self.task, f"v{version}", run.eval_samples, run.held_out_samples)
        self.metrics.held_out(version, {**result, "label": f"v{version}", "time_s": self.now(), "background": True})

    async def finish(self) -> None:
        """Wait for the evaluations still running (their results are part of the run)."""
        if self._pending:
            await asyncio.gather(*self._pending)


async def _load_newest(manager, executor: RuntimeExecutor, version: int) -> None:
    """Every engine onto policy `version` (the run's last published weights) before the end-of-run evaluation:
    the policy leaves engines on whatever version their last sync gave them (an asynchronous one a version or
    more behind), and the evaluation is of the weights the run ends with."""
    stale = [slot.name for slot in manager.router.slots if slot.version != version]
    if stale and version > 0:
        sources = await executor.sources(version, stale)
        await manager.pause(stale)
        await manager.update_weights(version, sources, stale)


def _engine_versions(manager) -> list[int]:
    """The policy versions the engines hold, each once."""
    return sorted({slot.version for slot in manager.router.slots})


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
