"""The one loop that runs a policy against an executor: events in, decisions out, deadlines kept.

Every executor (the simulator, the test fake, the real runtime) runs this loop instead of its own.
An executor implements `Executor` (a clock and one method per decision type) and reports what
happens with `Driver.post(event)`; `Driver.drain()` hands queued events to the policy one at a time
and dispatches each returned decision, in order, to the executor method of its type. The driver:

- knows which decisions are awaited (`core.events.awaits`) and fails the run with `DecisionTimeout`
  when one outlives its deadline (`Deadlines`) on the executor's clock;
- checks the contract: a completion must match an outstanding decision, and no decision may name a
  resource that is lost, unknown, or busy with an outstanding awaited decision (`ContractError`);
- on `ResourceLost`, abandons the outstanding decisions that named the resource before the policy
  sees the event, and ignores their late completions;
- records the control-plane phases on the timeline, the same way for every executor: a resource's
  `switch` or `sync` interval opens when the decision is dispatched and closes (to `idle`) when its
  completion is posted. The executor records every other phase (rollout, train, idle).

Two ways to feed it. A discrete-event executor (SimPy) calls `post` from its callbacks and `drain`
after each one; a `drain` called while draining returns at once, so events raised while decisions
are being applied reach the policy only after the current decision list. A real-time executor calls
`post` from any thread or asyncio callback and runs `Driver.run()` (blocking) or
`await Driver.run_async()` on its control thread; executor methods are then called on that thread,
with no lock of the driver's held, and must start their work and return, never wait for it (a
completion is posted later).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, assert_never

from core.errors import ContractError, DecisionTimeout, RunFailed
from core.events import (
    Completion,
    Decision,
    Event,
    Preempt,
    Refresh,
    ResourceIdle,
    ResourceLost,
    ResumeRollout,
    Started,
    StartTrain,
    Submit,
    SwitchTag,
    SyncWeights,
    awaits,
    completes,
    resources_of,
)
from core.policies.base import Policy
from core.tags import Phase
from core.timeline import TimelineRecorder


@dataclass(frozen=True)
class Deadlines:
    """How long each kind of awaited decision may take, in seconds of the executor's clock, before
    the run fails with `DecisionTimeout` (None: no limit). The defaults suit a real cluster; a
    simulator, whose durations come from a cost model and cannot hang, uses `Deadlines.none()`."""

    preempt_s: float | None = 300.0
    switch_s: float | None = 600.0
    sync_s: float | None = 600.0
    train_s: float | None = 3600.0

    def __post_init__(self) -> None:
        for name in ("preempt_s", "switch_s", "sync_s", "train_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"deadline {name} must be a positive number of seconds or None, got {value!r}")

    @classmethod
    def none(cls) -> Deadlines:
        return cls(None, None, None, None)

    def limit(self, decision: Decision) -> float | None:
        """The deadline of `decision` in seconds after it starts (None for fire-and-forget ones)."""
        match decision:
            case Preempt():
                return self.preempt_s
            case SwitchTag():
                return self.switch_s
            case SyncWeights():
                return self.sync_s
            case StartTrain():
                return self.train_s
            case Submit() | Refresh() | ResumeRollout():
                return None
            case _:
                assert_never(decision)


class Executor(Protocol):
    """What carries out decisions. Each method starts the decision and returns; an awaited one is
    completed later by posting its event to the driver (see core/events.py)."""

    def now(self) -> float:
        """Seconds since the run started, on the executor's clock: the time base of every interval.
        The driver calls it holding its lock: it must not block or take a lock held while posting."""
        ...

    def submit(self, decision: Submit) -> None: ...

    def preempt(self, decision: Preempt) -> None: ...

    def switch_tag(self, decision: SwitchTag) -> None: ...

    def start_train(self, decision: StartTrain) -> None: ...

    def refresh(self, decision: Refresh) -> None: ...

    def sync_weights(self, decision: SyncWeights) -> None: ...

    def resume_rollout(self, decision: ResumeRollout) -> None: ...


@dataclass
class _Outstanding:
    """An awaited decision the executor has not completed (or whose completion is still queued)."""

    decision: Decision
    started_s: float
    deadline_s: float | None  # absolute, on the executor's clock
    finished: bool = False  # its completion was posted
    opened: bool = False  # its switch or sync interval was recorded


class Driver:
    """Feeds `policy` the events an executor posts and dispatches its decisions to `executor`."""

    def __init__(
        self,
        policy: Policy,
        executor: Executor,
        recorder: TimelineRecorder | None = None,
        deadlines: Deadlines | None = None,
    ) -> None:
        self.policy, self.executor, self.recorder = policy, executor, recorder
        self.deadlines = Deadlines() if deadlines is None else deadlines
        self._timed = any(v is not None for v in vars(self.deadlines).values())
        self._lock = threading.RLock()  # guards the queue, the outstanding decisions and the recorder
        self._arrived = threading.Condition(self._lock)
        self._queue: deque[Event] = deque()
        self._outstanding: dict[Completion, _Outstanding] = {}
        self._busy: dict[str, Completion] = {}  # resource -> the outstanding decision on it
        self._abandoned: set[Completion] = set()
        self._known = set(policy.resources)
        self._lost: list[str] = []  # losses the policy has seen
        self._doomed: set[str] = set()  # losses posted (the policy may not have seen them yet)
        self._draining = False
        self._thread: int | None = None  # the control thread, once it drained
        self._wake_async: Callable[[], object] | None = None
        self.dispatched = 0  # decisions handed to the executor so far

    # ---- what an executor calls ----

    def start(self) -> None:
        """Post `Started` (the run's first event)."""
        self.post(Started())

    def post(self, event: Event) -> None:
        """Queue `event` for the policy. Safe from any thread; never calls the policy itself."""
        with self._lock:
            self._note_posted(event)
            self._queue.append(event)
            self._arrived.notify_all()
            wake = self._wake_async
        if wake is not None:
            wake()

    def drain(self) -> None:
        """Hand every queued event to the policy and dispatch its decisions until the queue is empty,
        then check deadlines. Call it from one thread only; a nested call returns at once."""
        if self._draining:
            return
        self._claim_thread()
        self._draining = True
        try:
            while (event := self._pop()) is not None:
                if self._accept(event):
                    for decision in self.policy.on_event(event):
                        self._dispatch(decision)
            if self._timed:
                self.check_deadlines()
        finally:
            self._draining = False

    def check_deadlines(self) -> None:
        """Raise `DecisionTimeout` for the oldest outstanding decision past its deadline, if any."""
        now = self.executor.now()
        with self._lock:
            late = [
                o
                for o in self._outstanding.values()
                if o.deadline_s is not None and not o.finished and now >= o.deadline_s
            ]
        if late:
            first = min(late, key=lambda o: o.started_s)
            limit = self.deadlines.limit(first.decision)
            raise DecisionTimeout(
                f"{first.decision!r} did not finish within {limit:g} s "
                f"(started at {first.started_s:.3f} s, now {now:.3f} s)"
            )

    def next_deadline(self) -> float | None:
        """The earliest deadline of an outstanding decision (executor clock), or None."""
        with self._lock:
            times = [o.deadline_s for o in self._outstanding.values() if o.deadline_s is not None and not o.finished]
        return min(times, default=None)

    @property
    def outstanding(self) -> list[Decision]:
        """Awaited decisions not completed yet, oldest first."""
        with self._lock:
            return [o.decision for o in sorted(self._outstanding.values(), key=lambda o: o.started_s)]

    @property
    def lost(self) -> tuple[str, ...]:
        return tuple(self._lost)

    # ---- running in real time ----

    def run(self, timeout_s: float | None = None) -> None:
        """Post `Started` and drain on the calling thread until the policy is done, waiting for
        events posted from other threads. Raises `DecisionTimeout`, `RunFailed` (also when
        `timeout_s` of the executor's clock pass first) or whatever the policy or executor raised."""
        end = None if timeout_s is None else self.executor.now() + timeout_s
        self.start()
        while True:
            self.drain()
            if self.policy.done:
                return
            with self._lock:
                if not self._queue:
                    self._arrived.wait(self._wait_s(end))
            self._check_end(end, timeout_s)

    async def run_async(self, timeout_s: float | None = None) -> None:
        """`run` for an asyncio executor: drains on the event loop's thread, which must not block;
        events may be posted from the loop or from other threads."""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()
        self._wake_async = lambda: loop.call_soon_threadsafe(arrived.set)
        end = None if timeout_s is None else self.executor.now() + timeout_s
        try:
            self.start()
            while True:
                self.drain()
                if self.policy.done:
                    return
                arrived.clear()
                with self._lock:
                    waiting = not self._queue
                if waiting:
                    try:
                        await asyncio.wait_for(arrived.wait(), self._wait_s(end))
                    except TimeoutError:
                        pass
                self._check_end(end, timeout_s)
        finally:
            self._wake_async = None

    def _wait_s(self, end: float | None) -> float | None:
        """How long to wait for an event: until the next deadline or the end of the run, if any."""
        times = [t for t in (self.next_deadline(), end) if t is not None]
        return None if not times else max(0.0, min(times) - self.executor.now())

    def _check_end(self, end: float | None, timeout_s: float | None) -> None:
        if end is not None and self.executor.now() >= end and not self.policy.done:
            pending = ", ".join(repr(d) for d in self.outstanding) or "none"
            raise RunFailed(
                f"run did not finish within {timeout_s:g} s: step {self.policy.step}, "
                f"{self.policy.in_flight} groups in flight, outstanding decisions: {pending}"
            )

    # ---- events ----

    def _claim_thread(self) -> None:
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        elif self._thread != me:
            raise ContractError("Driver.drain was called from two threads; drain on one control thread only")

    def _pop(self) -> Event | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def _note_posted(self, event: Event) -> None:
        """At post time (the executor's clock now): close the interval of the decision `event`
        completes, or of a lost resource. Called with the lock held."""
        key = completes(event)
        if key is not None:
            out = self._outstanding.get(key)
            if out is not None and not out.finished:
                out.finished = True
                if out.opened:
                    self._record_phase(out.decision, opening=False)
        elif isinstance(event, ResourceLost) and event.resource in self._known - self._doomed:
            self._doomed.add(event.resource)
            if self.recorder is not None:
                self.recorder.set(event.resource, Phase.IDLE, self.executor.now(), self.policy.step)

    def _accept(self, event: Event) -> bool:
        """Settle what `event` completes or abandons; False when the policy must not see it."""
        key = completes(event)
        with self._lock:
            if key is not None:
                return self._settle(key, event)
            match event:
                case ResourceLost(resource):
                    return self._abandon(resource)
                case ResourceIdle(resource):
                    return resource not in self._lost  # raced with the loss
            return True

    def _settle(self, key: Completion, event: Event) -> bool:
        out = self._outstanding.pop(key, None)
        if out is None:
            if key in self._abandoned:  # a late completion of a decision abandoned with a lost resource
                self._abandoned.discard(key)
                return False
            outstanding = ", ".join(repr(d) for d in self.outstanding) or "none"
            raise ContractError(f"{event!r} completes no outstanding decision (outstanding: {outstanding})")
        for resource in resources_of(out.decision):
            self._busy.pop(resource, None)
        return True

    def _abandon(self, resource: str) -> bool:
        if resource not in self._known:
            raise ContractError(f"ResourceLost names unknown resource {resource!r} (known: {sorted(self._known)})")
        if resource in self._lost:
            return False
        self._lost.append(resource)
        for key, out in list(self._outstanding.items()):
            if resource in resources_of(out.decision):
                del self._outstanding[key]
                self._abandoned.add(key)
                for name in resources_of(out.decision):
                    self._busy.pop(name, None)
        return True

    # ---- decisions ----

    def _dispatch(self, decision: Decision) -> None:
        """Check `decision`, register it if awaited, start it on the executor, open its phase.

        The executor method runs without the driver's lock, so it may post (from any thread). The
        phase opens after the method returns, so an executor can close its own interval on the
        resource first (the simulator pauses an engine, counting its tokens, before a sync); a
        decision whose completion was posted before that leaves no interval."""
        self.dispatched += 1
        key = awaits(decision)
        with self._lock:
            names = resources_of(decision)
            self._check_names(decision, names)
            decision = self._spare_doomed(decision, names, key)
            if decision is None:
                return
            if key is not None:
                now = self.executor.now()
                limit = self.deadlines.limit(decision)
                self._outstanding[key] = _Outstanding(decision, now, None if limit is None else now + limit)
                self._abandoned.discard(key)
                self._busy.update(dict.fromkeys(names, key))
        self._apply(decision)
        if key is None:
            return
        with self._lock:
            out = self._outstanding.get(key)
            if out is not None and out.decision is decision and not out.finished:
                out.opened = True
                self._record_phase(decision, opening=True)

    def _spare_doomed(self, decision: Decision, names: tuple[str, ...], key: Completion | None) -> Decision | None:
        """An executor is never asked to act on a resource it reported lost. A decision made before
        the policy saw the loss is abandoned if awaited (the policy issues it again once it sees the
        loss), or applied to the other resources if fire-and-forget. None: nothing to dispatch."""
        doomed = self._doomed.intersection(names)
        if not doomed:
            return decision
        if key is not None:
            self._abandoned.add(key)
            return None
        assert isinstance(decision, ResumeRollout), decision  # the only fire-and-forget one with resources
        survivors = tuple(r for r in names if r not in doomed)
        return ResumeRollout(survivors) if survivors else None

    def _check_names(self, decision: Decision, names: tuple[str, ...]) -> None:
        for name in names:
            if name not in self._known:
                raise ContractError(f"{decision!r} names unknown resource {name!r} (known: {sorted(self._known)})")
            if name in self._lost:
                raise ContractError(f"{decision!r} names lost resource {name!r}")
            if name in self._busy:
                busy = self._outstanding[self._busy[name]].decision
                raise ContractError(f"{decision!r} names {name!r}, which is still busy with {busy!r}")

    def _apply(self, decision: Decision) -> None:
        executor = self.executor
        match decision:
            case Submit():
                executor.submit(decision)
            case Preempt():
                executor.preempt(decision)
            case SwitchTag():
                executor.switch_tag(decision)
            case StartTrain():
                executor.start_train(decision)
            case Refresh():
                executor.refresh(decision)
            case SyncWeights():
                executor.sync_weights(decision)
            case ResumeRollout():
                executor.resume_rollout(decision)
            case _:
                assert_never(decision)

    # ---- control-plane phases on the timeline ----

    def _record_phase(self, decision: Decision, opening: bool) -> None:
        """Open (at dispatch) or close (at completion, to idle) a switch or sync interval."""
        if self.recorder is None:
            return
        now = self.executor.now()
        match decision:
            case SwitchTag(resource, active):
                phase, tag = (Phase.SWITCH, active.value) if opening else (Phase.IDLE, None)
                self.recorder.set(resource, phase, now, self.policy.step, active=tag)
            case SyncWeights(version, resources):
                for resource in resources:
                    self.recorder.set(resource, Phase.SYNC if opening else Phase.IDLE, now, version)
