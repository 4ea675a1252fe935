"""A seeded executor without physics, to check a policy against the contract of `core/events.py`.

It runs the shared driver (`core.driver.Driver`) on a discrete clock. Every decision takes a random
time, the fire-and-forget ones too (their effect lands later, with no event), so completions arrive
in random orders. A group's tokens all come from the weights the rollout pool holds when it starts
(or restarts); a weight sync restarts in-flight groups older than its `min_keep_version`, as the
simulator does. It checks what an executor can see (a switch to training only on a resource that
holds no request, training only on train-active resources, no group trained twice) and records the
steps trained, the policy-version lag of every trained group and the rollout version behind every
`Submit`.

A fire-and-forget decision that names resources (`ResumeRollout`) lands after a random delay too,
but before any later decision on the same resource starts, as the contract requires.

Faults: `lose(resource, at_s)` reports `ResourceLost` at a time and abandons that resource's
decisions; `silent` names decision types whose completion never comes (a resource that died without
a word), so that the driver's deadline ends the run.

Three ways to run it, one per way of feeding the driver: `run` on a discrete clock (deterministic
for a seed, like the simulator), `run_threaded` in real time with the effects fired by a second
thread (`Driver.run`), and `run_asyncio` with the effects as event-loop timers (`Driver.run_async`).
In real time one fake second lasts `second_s` of wall time and deadlines are in wall seconds.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import random
import threading
import time
from collections.abc import Callable
from itertools import count

from core.driver import Deadlines, Driver
from core.errors import ContractError
from core.events import (
    Decision,
    GroupFinished,
    Preempt,
    PreemptFinished,
    Refresh,
    ResourceIdle,
    ResourceLost,
    ResumeRollout,
    StartTrain,
    Submit,
    SwitchFinished,
    SwitchTag,
    SyncFinished,
    SyncWeights,
    TrainFinished,
    resources_of,
)
from core.policies.base import Policy
from core.tags import Tag


def _locked(method: Callable) -> Callable:
    """Run an executor method under the fake's mutex (the effects thread runs under it too)."""

    @functools.wraps(method)
    def wrapper(self: FakeExecutor, *args):
        with self._mutex:
            return method(self, *args)

    return wrapper


class FakeExecutor:
    """Replays a policy's decisions as completion events after seeded random delays."""

    def __init__(self, policy: Policy, seed: int, deadlines: Deadlines | None = None, idle_chance: float = 0.3):
        self.policy, self.rng, self.idle_chance = policy, random.Random(seed), idle_chance
        self.driver = Driver(policy, self, deadlines=deadlines or Deadlines.none())
        self.clock = 0.0  # the discrete clock (`run`)
        self._t0: float | None = None  # wall-clock start of a real-time run
        self._second_s = 1.0  # executor seconds per fake second
        self._heap: list[tuple[float, int, Callable, tuple]] = []  # (executor time, tiebreak, effect, args)
        self._seq = count()
        self._mutex = threading.Lock()
        self._tick = threading.Condition(self._mutex)
        self._stopped = False
        self._timer: Callable[[float, Callable, tuple], object] = self._push
        self._losses: list[tuple[float, str]] = []
        self.error: BaseException | None = None  # raised by an effect in a real-time run
        self.active = {r: policy.initial_active(r) for r in policy.resources}
        self.holding = {r for r, tag in self.active.items() if tag is Tag.ROLLOUT}  # may hold requests
        self.weights = dict.fromkeys(policy.resources, 0)
        self.silent: set[type] = set()
        self._tickets: dict[int, Decision] = {}  # awaited decisions not completed or abandoned
        self._resuming: dict[str, int] = {}  # resource -> ticket of a ResumeRollout not landed yet
        self.group_version: dict[int, int] = {}  # in flight -> version it is generated with
        self.finished_version: dict[int, int] = {}
        self._restarts: dict[int, int] = {}  # invalidates the completion of a restarted group
        self.next_gid = 0
        self.trained: list[int] = []
        self.steps: list[int] = []
        self.lags: list[int] = []
        self.submits: list[int] = []  # rollout version at each Submit

    def now(self) -> float:
        """Takes no lock: the driver calls it with its own lock held."""
        return self.clock if self._t0 is None else time.monotonic() - self._t0

    # ---- the loops ----

    def run(self, max_events: int = 20_000) -> None:
        """Run on the discrete clock until the policy is done; raises what the driver or policy raises."""
        self._schedule_losses()
        self.driver.start()
        self.driver.drain()
        for _ in range(max_events):
            if self.policy.done:
                return
            if not self._heap:
                self._wait_for_deadline()
            self.clock, _, fn, args = heapq.heappop(self._heap)
            with self._mutex:
                fn(*args)
            self.driver.drain()
        raise RuntimeError(f"not done after {max_events} events")

    def _wait_for_deadline(self) -> None:
        """Nothing will happen any more: jump to the next deadline, where the driver fails the run."""
        deadline = self.driver.next_deadline()
        if deadline is None:
            raise RuntimeError(f"the policy waits for an event that cannot come ({self.driver.outstanding=})")
        self.clock = deadline
        self.driver.check_deadlines()
        raise RuntimeError(f"no DecisionTimeout at the deadline {deadline} s")

    def run_threaded(self, second_s: float = 0.002, timeout_s: float = 60.0) -> None:
        """Run in real time: a second thread fires the effects and posts events; `Driver.run` drains
        on this one."""
        self._t0, self._second_s = time.monotonic(), second_s
        self._schedule_losses()
        world = threading.Thread(target=self._fire, name="fake-executor", daemon=True)
        world.start()
        try:
            self.driver.run(timeout_s)
        except BaseException:
            if self.error is not None:
                raise self.error from None
            raise
        finally:
            with self._tick:
                self._stopped = True
                self._tick.notify()
            world.join()

    async def run_asyncio(self, second_s: float = 0.002, timeout_s: float = 60.0) -> None:
        """Run in real time on the running event loop: effects are `call_later` timers."""
        loop = asyncio.get_running_loop()
        self._t0, self._second_s = time.monotonic(), second_s
        self._timer = lambda delay, fn, args: loop.call_later(delay * second_s, fn, *args)
        for at_s, resource in self._losses:
            loop.call_later(at_s * second_s, self._lose, resource)
        await self.driver.run_async(timeout_s)

    def _fire(self) -> None:
        """The effects thread: run each timed effect when its time comes, under the mutex."""
        with self._tick:
            while not self._stopped:
                wait = self._heap[0][0] - self.now() if self._heap else None
                if wait is None or wait > 0:
                    self._tick.wait(wait)
                    continue
                _, _, fn, args = heapq.heappop(self._heap)
                try:
                    fn(*args)
                except BaseException as exc:  # surfaced by run_threaded once the driver gives up
                    self.error, self._stopped = exc, True

    def _schedule_losses(self) -> None:
        for at_s, resource in self._losses:
            heapq.heappush(self._heap, (at_s * self._second_s, next(self._seq), self._lose, (resource,)))

    def _push(self, delay: float, fn: Callable, args: tuple) -> None:
        """Schedule an effect on the heap (the discrete loop or the effects thread runs it)."""
        heapq.heappush(self._heap, (self.now() + delay * self._second_s, next(self._seq), fn, args))
        self._tick.notify()  # the caller holds the mutex

    def _later(self, fn: Callable, *args, low: float = 0.1, high: float = 2.0) -> None:
        self._timer(self.rng.uniform(low, high), fn, args)

    def _complete_later(self, decision: Decision, event) -> None:
        """Post `event` after a random delay unless the decision is abandoned or its type silent."""
        if type(decision) in self.silent:
            return
        ticket = next(self._seq)
        self._tickets[ticket] = decision
        self._later(self._complete, ticket, event)

    def _complete(self, ticket: int, event) -> None:
        decision = self._tickets.pop(ticket, None)
        if decision is None:
            return  # abandoned: its resource was lost
        match event:
            case TrainFinished():
                self._record_step(decision)
            case SyncFinished(version, resources, _):
                self._load(version, resources, decision.min_keep_version)
            case PreemptFinished(resource):
                self.holding.discard(resource)
            case SwitchFinished(resource, active):
                self.active[resource] = active
        self.driver.post(event)
        if self.policy.rollout_only and self.rng.random() < self.idle_chance:
            self._later(self._idle, self.rng.choice(self.policy.rollout_only))

    def _idle(self, resource: str) -> None:
        if resource in self.active:
            self.driver.post(ResourceIdle(resource))

    # ---- faults ----

    def lose(self, resource: str, at_s: float) -> None:
        """Report `ResourceLost(resource)` at `at_s` fake seconds (call before running)."""
        self._losses.append((at_s, resource))

    def _lose(self, resource: str) -> None:
        for ticket, decision in list(self._tickets.items()):
            if resource in resources_of(decision):
                del self._tickets[ticket]
        del self.active[resource]
        self._resuming.pop(resource, None)
        self.holding.discard(resource)
        self.driver.post(ResourceLost(resource))

    # ---- groups ----

    def rollout_version(self) -> int:
        pool = self.policy.rollout_only or self.policy.trainers
        return min(self.weights[r] for r in pool)

    def _start_group(self, gid: int) -> None:
        self.group_version[gid] = self.rollout_version()
        self._restarts[gid] = self._restarts.get(gid, 0) + 1
        self._later(self._group_done, gid, self._restarts[gid])

    def _group_done(self, gid: int, restarts: int) -> None:
        if restarts == self._restarts[gid]:
            self.finished_version[gid] = self.group_version.pop(gid)
            self.driver.post(GroupFinished(gid, self.finished_version[gid]))

    def _load(self, version: int, resources: tuple[str, ...], floor: int) -> None:
        for name in resources:
            self.weights[name] = version
        self.holding.update(resources)
        for gid, v in list(self.group_version.items()):
            if v < floor:
                self._start_group(gid)

    def _record_step(self, d: StartTrain) -> None:
        if set(d.group_ids) & set(self.trained):
            raise ContractError(f"{d!r} trains a group twice")
        self.trained += d.group_ids
        self.steps.append(d.step)
        self.lags += [d.step - self.finished_version[g] for g in d.group_ids]

    # ---- decisions (the Executor protocol) ----

    @_locked
    def submit(self, d: Submit) -> None:
        if d.num_groups < 1:
            raise ContractError(f"{d!r} submits no group")
        self.submits.append(self.rollout_version())
        for _ in range(d.num_groups):
            self._later(self._start_group, self.next_gid, low=0.0, high=1.0)
            self.next_gid += 1

    @_locked
    def refresh(self, d: Refresh) -> None:
        for gid in d.group_ids:
            if gid not in self.finished_version or gid in self.trained:
                raise ContractError(f"{d!r}: group {gid} is not finished and untrained")
            self._later(self._start_group, gid, low=0.0, high=1.0)

    @_locked
    def start_train(self, d: StartTrain) -> None:
        self._land(resources_of(d))
        self._require(d, all(self.active[r] is Tag.TRAIN for r in d.resources), "trains on a resource not train-active")
        self._require(d, len(set(d.group_ids)) == len(d.group_ids) == self.policy.config.batch_groups, "bad batch")
        self._complete_later(d, TrainFinished(d.step))

    @_locked
    def preempt(self, d: Preempt) -> None:
        self._land(resources_of(d))
        self._require(d, self.active[d.resource] is Tag.ROLLOUT, "preempts a resource not rollout-active")
        self._complete_later(d, PreemptFinished(d.resource))

    @_locked
    def switch_tag(self, d: SwitchTag) -> None:
        self._land(resources_of(d))
        self._require(d, self.policy.resources[d.resource].capabilities == {Tag.ROLLOUT, Tag.TRAIN}, "one role only")
        if d.active is Tag.TRAIN:
            idle = d.resource not in self.holding or self.policy.in_flight == 0
            self._require(d, idle, "switches to training a resource that may hold requests (preempt it first)")
            self.holding.discard(d.resource)
        self._complete_later(d, SwitchFinished(d.resource, d.active))

    @_locked
    def sync_weights(self, d: SyncWeights) -> None:
        self._land(resources_of(d))
        self._require(d, all(self.active[r] is Tag.ROLLOUT for r in d.resources), "syncs a resource not rolling out")
        self._require(d, d.min_keep_version <= d.version <= self.policy.version, "loads a version that does not exist")
        self._complete_later(d, SyncFinished(d.version, d.resources, d.sync_id))

    @_locked
    def resume_rollout(self, d: ResumeRollout) -> None:
        self._require(d, all(self.active[r] is Tag.ROLLOUT for r in d.resources), "resumes a resource not rolling out")
        self._land(d.resources)
        ticket = next(self._seq)
        self._resuming.update(dict.fromkeys(d.resources, ticket))
        self._later(self._resumed, d.resources, ticket, low=0.0, high=1.0)

    def _resumed(self, resources: tuple[str, ...], ticket: int) -> None:
        self._land(tuple(r for r in resources if self._resuming.get(r) == ticket))

    def _land(self, resources: tuple[str, ...]) -> None:
        """Resumes on `resources` that have not landed yet land now (a later decision names them)."""
        for r in resources:
            if self._resuming.pop(r, None) is not None:
                self.holding.add(r)

    @staticmethod
    def _require(d: Decision, ok: bool, what: str) -> None:
        if not ok:
            raise ContractError(f"{d!r} {what}")
