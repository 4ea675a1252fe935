"""The runtime executor: `core.driver`'s decisions applied to real engines, trainer shards and prompt groups.

The counterpart of `sim/runner.py`. It runs on the trajectory manager's event loop (the manager is
embedded in the driver process) and never blocks it: each decision starts an asyncio task and returns;
its completion is posted to the driver when the work is done. What each decision does here:

    Submit(n)           the rollout manager starts n prompt groups (GroupFinished when each is rewarded)
    Preempt(r)          the manager stops routing to r's engine and moves its requests, with their
                        tokens, to other engines (partial rollout)          -> PreemptFinished
    SwitchTag(r, tag)   train: r's engine takes no request; rollout: it serves again -> SwitchFinished
    StartTrain(k, ...)  the groups' trajectories are read from the manager's store, split by group over
                        the train shards (data parallel), one optimiser step, the new weights published
                        as version k+1, the groups marked consumed in the store -> TrainFinished
    SyncWeights(v, rs)  wait for version v to be where rs' engines can read it, pause them at a token
                        boundary, restart requests older than the bound, load version v, resume engines
                        that hold no request -> SyncFinished
    Refresh / ResumeRollout   regenerate stale samples / resume paused engines

How a published version reaches the engines is the run's weight transport (`reference/control/transport.py`):
a directory under the run's weights root that every engine reads, or Ray's object store and a copy on each
engine's node.

Resources are reached through a `WorkerGroup`'s typed handles (`reference/control/calls.py`: Ray actors by default;
in-process for tests), whose calls return the workers' records. Any failure in
this work stops the run with an error that names the decision; nothing waits for ever (the driver's
deadlines cover what an engine or a shard never finishes).

Sandbox lanes: as each group finishes, what its episodes' sandboxes did (`episodes.SANDBOX_SPANS` in their
info, unix seconds) goes on the timeline's sandbox lanes, in the run's time base. Episodes without a verdict
(dropped from their group) and held-out evaluations are not seen here, so their sandboxes are not drawn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from core import events as ev
from core.tags import Phase, SandboxPhase, Tag
from core.timeline import SandboxInterval, StepRecord, TimelineRecorder
from reference.control.calls import WorkerGroup
from reference.control.worker import WeightsCopy
from reference.manager.manager import TrajectoryManager
from reference.rollout.episodes import SANDBOX_SPANS, TIMING_KEYS, Episode
from reference.rollout.groups import GroupResult, RolloutManager, training_batch
from reference.trainer.batch import Trajectory
from reference.trainer.trainer import StepMetrics

log = logging.getLogger(__name__)
_SANDBOX_KINDS = frozenset(p.value for p in SandboxPhase)


class Sink(Protocol):
    def step(self, record: dict, held_out: dict | None) -> None:
        """One finished training step's metrics (see `step_metrics`), and the held-out
        evaluation of its weights when there was one."""


@dataclass
class _State:
    """What the executor tracks between decisions."""

    trainers: tuple[str, ...]  # the data-parallel group, in rank order
    step_started_s: dict[int, float] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)
    failure: BaseException | None = None


class RuntimeExecutor:
    def __init__(
        self,
        manager: TrajectoryManager,
        rollout: RolloutManager,
        workers: WorkerGroup,
        recorder: TimelineRecorder,
        trainers: Sequence[str],
        weights_root: Path,
        sink: Sink,
        offset: int = 0,
        evaluate: Callable[[int], Awaitable[dict | None]] | None = None,
        transport=None,
    ) -> None:
        """`offset`: steps trained before this run began (a resumed run). The policy counts its steps and
        versions from 0; engines, trainer shards, the store and the metrics use the run's true numbers,
        which are the policy's plus `offset` (a resumed run's older groups have negative policy versions).
        `transport`: how versions reach the engines (`reference.control.transport`; None: a directory under
        `weights_root` that every engine reads)."""
        from reference.control.transport import DirectoryTransport

        self.manager, self.rollout, self.workers, self.recorder = manager, rollout, workers, recorder
        self.weights_root, self.sink, self.offset = weights_root, sink, offset
        self.newest = offset  # the newest version published (a resumed run starts from its checkpoint's)
        self.evaluate = evaluate  # new version -> its held-out evaluation (None: not this one, or not yet)
        self.keep_version: Callable[[int], bool] = lambda v: v == 0  # published versions never pruned
        self.transport = transport or DirectoryTransport(workers, weights_root, lambda v: self.keep_version(v))
        self.state = _State(tuple(trainers))
        self.post: Callable[[ev.Event], None] = lambda e: None  # the driver's post, set by `attach`
        self._t0 = time.monotonic()
        self._t0_unix = time.time()
        self.sync_s: list[float] = []
        self.restarted = 0  # requests the syncs started over from their prompt (too old to train on)
        self._drawn: set[str] = set()  # sessions whose sandbox spans are on the timeline (a refresh keeps some)
        announce = rollout.on_group  # the groups' sandbox lanes are recorded as they finish, then announced

        def on_group(group: GroupResult) -> None:
            self._record_sandboxes(group.episodes)
            announce(group)

        rollout.on_group = on_group

    def attach(self, post: Callable[[ev.Event], None]) -> None:
        self.post = post
        self._t0, self._t0_unix = time.monotonic(), time.time()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _record_sandboxes(self, episodes: Sequence[Episode]) -> None:
        """Each episode's sandbox spans on the timeline's lanes (unix seconds -> the run's seconds; what lies before
        the run is clipped, what outlasts it is clipped when the timeline is finished); spans of a kind unknown
        here are left out."""
        for e in episodes:
            if e.session_id in self._drawn:
                continue
            self._drawn.add(e.session_id)
            for lane, kind, start, end in e.info.get(SANDBOX_SPANS, ()):
                start_s, end_s = max(0.0, start - self._t0_unix), end - self._t0_unix
                if kind in _SANDBOX_KINDS and end_s > start_s:
                    self.recorder.add_sandbox(SandboxInterval(lane, SandboxPhase(kind), start_s, end_s, e.session_id))

    @property
    def failure(self) -> BaseException | None:
        return self.state.failure or self.rollout.failure or self.transport.failure

    # ---- decisions ----

    def submit(self, d: ev.Submit) -> None:
        self.rollout.submit(d.num_groups)

    def refresh(self, d: ev.Refresh) -> None:
        self.rollout.refresh(d.group_ids, d.min_keep_version + self.offset)

    def preempt(self, d: ev.Preempt) -> None:
        self._spawn(d, self._preempt(d))

    def switch_tag(self, d: ev.SwitchTag) -> None:
        self._spawn(d, self._switch(d))

    def start_train(self, d: ev.StartTrain) -> None:
        self._spawn(d, self._train(d))

    def sync_weights(self, d: ev.SyncWeights) -> None:
        self._spawn(d, self._sync(d))

    def resume_rollout(self, d: ev.ResumeRollout) -> None:
        self._spawn(d, self.manager.resume(list(d.resources)))

    # ---- the work ----

    def _spawn(self, decision: ev.Decision, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.state.tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self.state.tasks.discard(t)
            if not t.cancelled() and t.exception() is not None and self.state.failure is None:
                self.state.failure = RuntimeError(f"{decision!r} failed: {t.exception()}")
                self.state.failure.__cause__ = t.exception()

        task.add_done_callback(done)

    async def _preempt(self, d: ev.Preempt) -> None:
        moved = await self.manager.preempt(d.resource)
        log.debug("preempted %s: %d requests moved", d.resource, moved)
        self.post(ev.PreemptFinished(d.resource))

    async def _switch(self, d: ev.SwitchTag) -> None:
        serving = d.active is Tag.ROLLOUT
        if not serving and (held := self.manager.router.slot(d.resource).calls):
            raise RuntimeError(f"{d.resource} still holds {len(held)} requests; it must be preempted first")
        self.manager.set_serving(d.resource, serving)
        self.post(ev.SwitchFinished(d.resource, d.active))

    async def _train(self, d: ev.StartTrain) -> None:
        if tuple(d.resources) != self.state.trainers:
            raise RuntimeError(
                f"the data-parallel group is {list(self.state.trainers)}; a step on "
                f"{list(d.resources)} is not supported"
            )
        start, step = self.now(), d.step + self.offset
        for r in d.resources:
            self.recorder.set(r, Phase.TRAIN, start, step)
        groups = self.rollout.take(d.group_ids)
        # Consumed before the trainers step: a trainer writes its checkpoint inside `train_step`, so a run killed
        # after that checkpoint must find these groups consumed (a resume releases the markers of the steps from
        # its checkpoint on, so a kill before it loses nothing).
        await asyncio.to_thread(self.manager.store.mark_consumed, [g.key for g in groups], step)
        batch = await asyncio.to_thread(training_batch, self.manager.store, groups)
        shards = _shard(groups, batch, len(d.resources))
        results = await asyncio.gather(
            *(self.workers.trainer(r).train_step(shard) for r, shard in zip(d.resources, shards, strict=True))
        )
        handoff = await self.transport.publish(d.resources, step + 1)
        if handoff.version != step + 1:
            raise RuntimeError(f"step {step} published version {handoff.version}, not {step + 1}")
        self.newest = max(self.newest, step + 1)
        held_out = None  # an evaluation of the new weights is trainer work: it counts as train time
        if self.evaluate is not None:
            held_out = await self.evaluate(step + 1)
        end = self.now()
        record = _step_record(step, start, end, batch)
        for r, shard in zip(d.resources, shards, strict=True):
            self.recorder.add_tokens(r, sum(len(t.token_ids) for t in shard))
            self.recorder.set(r, Phase.IDLE, end, step + 1)
        self.recorder.add_step(record)
        self.sink.step(step_metrics(step, groups, results, handoff, record), held_out)
        self.post(ev.TrainFinished(d.step))

    async def _sync(self, d: ev.SyncWeights) -> None:
        start = time.perf_counter()
        engines, version = list(d.resources), d.version + self.offset
        sources = await self.sources(version, engines)  # before the pause: the engines generate while it comes
        await self.manager.pause(engines)
        self.restarted += await self.manager.restart_older_than(d.min_keep_version + self.offset, engines)
        await self.manager.update_weights(version, sources, engines)
        idle = [e for e in engines if not self.manager.router.slot(e).calls]
        if idle:
            await self.manager.resume(idle)
        self.sync_s.append(time.perf_counter() - start)
        self.post(ev.SyncFinished(d.version, d.resources, d.sync_id))

    async def sources(self, version: int, engines: Sequence[str]) -> str | Mapping[str, str]:
        """Where `engines` load `version` from (`TrajectoryManager.update_weights`' source): one directory every
        engine reads, or each engine's own copy on its node, waited for where it is still being made."""
        return await self.transport.sources(version, engines)

    async def close(self) -> None:
        for task in list(self.state.tasks):
            task.cancel()
        await asyncio.gather(*self.state.tasks, return_exceptions=True)


def step_metrics(step: int, groups, results: list[StepMetrics], handoff: WeightsCopy, record: StepRecord) -> dict:
    """A finished step's line in metrics.jsonl: its groups' rewards and episodes, the shards' figures (`results`,
    one a rank), the publish of its version and its timeline record."""
    rewards = [s.reward for g in groups for s in g.episodes]
    timings = {k: sum(e.info.get(k, 0.0) for g in groups for e in g.episodes) for k in TIMING_KEYS}
    n = len(rewards)
    mean = sum(rewards) / n
    tokens = results[0].tokens  # every rank reports the step's global count
    train_s = max(r.time_s for r in results)
    return {
        "step": step,
        "reward_mean": mean,
        "reward_std": (sum((x - mean) ** 2 for x in rewards) / n) ** 0.5,
        "exact_match": sum(s.exact for g in groups for s in g.episodes) / n,
        "samples": n,
        "trained_tokens": tokens,  # generated tokens in the loss
        "generated_tokens": record.generated_tokens,
        "staleness": {str(k): v for k, v in sorted(record.lag_tokens.items())},
        "loss": _mean(results, [r.loss for r in results]),
        "kl": _mean(results, [r.kl for r in results]),
        "entropy": _mean(results, [r.entropy for r in results]),
        "clip_fraction": _mean(results, [r.clip_fraction for r in results]),
        "grad_norm": results[0].grad_norm,
        "train_s": train_s,
        "publish_s": handoff.seconds,
        "step_s": record.end_s - record.start_s,
        "time_s": record.end_s,
        "tokens_per_s_trained": tokens / max(1e-9, train_s),
        "episodes": {
            "exit_reasons": dict(Counter(e.exit_reason for g in groups for e in g.episodes)),
            **{f"{k}_sum": v for k, v in timings.items()},
        },
        **results[0].to_metrics(),  # the trainer's own figures, global over the ranks
    }


def _mean(results: Sequence[StepMetrics], values: Sequence[float]) -> float:
    """A token-weighted mean over the shards of `values`, one a shard."""
    total = sum(r.tokens for r in results)
    return sum(v * r.tokens for v, r in zip(values, results, strict=True)) / max(1, total)


def _shard(groups: Sequence[GroupResult], batch: list[Trajectory], n: int) -> list[list[Trajectory]]:
    """Whole groups (GRPO normalises within a group) to each of `n` shards, balanced by tokens: largest
    group first, each to the shard with the fewest tokens so far (ties: the lowest rank). A step waits for
    its slowest rank, and with long-tailed lengths a round robin can give one rank most of the tokens."""
    shards: list[list[Trajectory]] = [[] for _ in range(n)]
    tokens: dict[str, int] = {g.key: 0 for g in groups}
    for t in batch:
        tokens[t.group_id] += len(t.token_ids)
    load, rank = [0] * n, {}
    for key in sorted(tokens, key=lambda k: -tokens[k]):  # stable: ties keep the groups' order
        rank[key] = r = min(range(n), key=lambda i: (load[i], i))
        load[r] += tokens[key]
    for t in batch:
        shards[rank[t.group_id]].append(t)
    if any(not s for s in shards):
        raise RuntimeError(f"{len(groups)} groups cannot feed {n} data-parallel shards")
    return shards


def _step_record(step: int, start: float, end: float, batch: list[Trajectory]) -> StepRecord:
    lag: Counter[int] = Counter()
    for t in batch:
        for v in t.versions:
            lag[step - v] += 1
    generated = sum(t.num_generated for t in batch)
    return StepRecord(
        step, start, end, sum(len(t.token_ids) for t in batch), generated, dict(sorted(lag.items())), len(batch)
    )
