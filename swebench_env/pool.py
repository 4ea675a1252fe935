"""Sandboxes at rollout scale: a bounded pool that starts containers before the episodes that need them.

An agent episode uses two fresh containers: its workspace (the task's checkout at /testbed) and, once the
agent is done, the grader's. Started on demand, each start (`docker create` and `start`, the image's
writable places filled, the checkout copied in: 1-3 s on a busy 2-core machine) sits on the episode's
critical path. `SandboxPool` takes it off:

- **spares**: for each kind of sandbox it is asked for (one `SandboxConfig`: the agent's workspace or the
  grader, per image), it keeps up to `spares` containers started in the background. A lease takes one where
  there is one, and another starts behind it. At most `2 * spares` spares are kept in all: a new kind
  (another task's image) evicts the spares of the kind leased least recently;
- **a lease never waits for a start**: a workspace lease without a spare returns at once, its container
  starts (and the checkout is copied in) in the background while the agent's first model call runs; the
  agent's first command waits only for what is left of the start (`Lease.waited_s`);
- **at most `slots` leases at once** (the task's `concurrency`); one more waits for a free slot;
- **episodes first**: spares start one at a time, and not while a lease waits for its start or checkout
  (for at most `SPARE_DEFER_S`): on a small machine concurrent starts slow each other down.

Every leased container is removed when its lease ends (the episode finished, crashed, or was cancelled),
in the background, so the episode does not wait for it either; spares when the pool closes. A start still
under way when its lease or the pool has ended removes its container when it is done. The containers are
`Sandbox`es, so the process's exit hooks and `close_open_sandboxes` remove them too, and they carry the
owner labels of `reaper.py`: what a killed process left is removed by the next run's start.
Spares are started before their task is known, so no container carries the `seamlessflow.instance` label.

For the run's timeline, each container lives on a lane (`sandbox-0`, `sandbox-1`, ...: the lowest free one
when it is created, freed once it is removed; about `slots + 2 * spares` lanes) and records what it held
there as `Span`s in unix seconds, named as `core.tags.SandboxPhase`: start, spare, model (an episode holds
it while its agent waits for the model), tool (a command) and test_run (the grader's run). An episode's
spans travel in its `Episode.info` (`reference.rollout.episodes.SANDBOX_SPANS`) to the run's timeline.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from core.tags import SandboxPhase
from swebench_env.docker_util import docker_client
from swebench_env.grading import (
    TESTBED,
    DockerGrader,
    DockerGraderConfig,
    GradingError,
    checkout_archive,
)
from swebench_env.sandbox import ExecResult, Sandbox, SandboxConfig, SandboxError
from swebench_env.sandbox_files import copy_in
from swebench_env.tasks import Instance, is_official

LANE_PREFIX = "sandbox-"
START_TIMEOUT_S = 900.0  # a lease's container started and its checkout copied in (the copy alone may take 600 s)
SLOT_TIMEOUT_S = 3600.0  # a lease waits this long for a free slot (the other leases' episodes have their limits)
SPARE_DEFER_S = 30.0  # a spare's start waits at most this long for the leases' starts to be done
MIN_GAP_S = 1e-3  # shorter stretches between spans are not recorded as gaps
AGENT_ROLE = {"seamlessflow.role": "agent"}
GRADER_ROLE = {"seamlessflow.role": "grader"}


@dataclass(frozen=True)
class Span:
    """What sandbox lane `lane` held from `start` to `end` (unix seconds)."""

    lane: str
    kind: SandboxPhase
    start: float
    end: float

    def as_tuple(self) -> tuple[str, str, float, float]:
        """Plain data, as an Episode's info carries it: (lane, kind, start, end)."""
        return (self.lane, self.kind.value, self.start, self.end)


@dataclass(frozen=True)
class PoolStats:
    leased: int  # leases open now
    spares: int  # spares now (started, or starting)
    spares_ready: int  # spares started and waiting
    containers: int  # containers the pool holds now: leased, spare, starting, or being removed
    lanes: int  # lanes used so far
    spare_hits: int  # leases that took a spare
    spare_misses: int  # leases that started a container of their own


class _Box:
    """One container of the pool: its lane, its start (a Future of the started Sandbox), and its spans."""

    def __init__(self, sandbox: Sandbox, lane: int) -> None:
        self.sandbox, self.lane = sandbox, f"{LANE_PREFIX}{lane}"
        self.index = lane
        self.started: Future[Sandbox] = Future()
        self.began = False  # its start is under way (or done)
        self.ready_at: float | None = None  # unix seconds
        self.lock = threading.Lock()
        self.spans: list[Span] = []
        self.dropped = False  # nobody will use it: remove it once its start is done
        self.removed = False

    def add(self, kind: SandboxPhase, start: float, end: float) -> None:
        with self.lock:
            self.spans.append(Span(self.lane, kind, start, end))


class SandboxPool:
    """Containers for `slots` episodes at once, `spares` of each kind started ahead (see the module docstring).
    Thread-safe; `close()` (or leaving a `with` block) removes the spares and waits for starts under way."""

    def __init__(self, slots: int, spares: int = 1, client=None) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"SandboxPool slots={slots!r} must be an integer >= 1")
        if not isinstance(spares, int) or spares < 0:
            raise ValueError(f"SandboxPool spares={spares!r} must be an integer >= 0")
        self.slots, self.spares = slots, spares
        self.client = client or docker_client()
        self._free = threading.BoundedSemaphore(slots)
        self._lock = threading.Lock()
        self._no_lease_starting = threading.Condition(self._lock)
        self._lease_starts = 0  # leases whose container (or checkout) is not ready yet
        self._idle: dict[str, deque[_Box]] = {}  # kind (a config's key) -> its spares, oldest first
        self._leased_at: dict[str, float] = {}  # kind -> when it was last leased
        self._lanes: list[bool] = []  # lane -> taken
        self._boxes: set[_Box] = set()
        # Leases' starts, checkouts and removals; a checkout waits for its start, so more workers than checkouts (at
        # most one a lease) are needed. Spares start one at a time in a worker of their own: they must not slow
        # down the starts that episodes wait for.
        self._work = ThreadPoolExecutor(2 * slots + 2, thread_name_prefix="sandbox-pool")
        self._spare_work = ThreadPoolExecutor(1, thread_name_prefix="sandbox-spare")
        self._closed = False
        self._leased = self._hits = self._misses = 0

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> PoolStats:
        with self._lock:
            spares = [box for queue in self._idle.values() for box in queue]
            ready = sum(box.ready_at is not None for box in spares)
            return PoolStats(
                self._leased, len(spares), ready, len(self._boxes), len(self._lanes), self._hits, self._misses
            )

    def names(self) -> dict[str, list[str]]:
        """The container names the pool holds now, by state: leased and spare (for tests and operators)."""
        with self._lock:
            spare = {b.sandbox.name for q in self._idle.values() for b in q}
            leased = {b.sandbox.name for b in self._boxes if b.sandbox.name not in spare and not b.dropped}
        return {"leased": sorted(leased), "spare": sorted(spare)}

    def episode(self, image: str | None = None, test_timeout_s: float | None = None) -> EpisodeSandboxes:
        """The workspace and grader of one episode (`image`: for local-repository tasks, None: the base image)."""
        limits = {} if test_timeout_s is None else {"test_timeout_s": test_timeout_s}
        return EpisodeSandboxes(self, image, DockerGraderConfig(image=image, **limits))

    @contextmanager
    def lease(
        self, config: SandboxConfig, prepare: Callable[[Sandbox], None] | None = None, gap=SandboxPhase.MODEL
    ) -> Iterator[Lease]:
        """A container of `config` for the `with` block: a spare, or one starting in the background; then
        `prepare(sandbox)` (copying a checkout in) in the background. `gap`: what the lane holds between the
        lease's recorded spans (the agent waiting for the model)."""
        if not self._free.acquire(timeout=SLOT_TIMEOUT_S):
            raise SandboxError(f"no sandbox slot came free in {SLOT_TIMEOUT_S:g} s (all {self.slots} are leased)")
        try:
            lease = self._open(config, prepare, gap)
            try:
                yield lease
            finally:
                lease._end()
        finally:
            self._free.release()

    def close(self, wait: bool = True) -> None:
        """No more leases or spares, the idle spares removed; with `wait`, the starts, checkouts and removals under
        way waited for too. Containers still leased are removed when their leases end (or by
        `sandbox.close_open_sandboxes`)."""
        with self._lock:
            self._closed = True
            idle = [box for queue in self._idle.values() for box in queue]
            self._idle.clear()
            self._no_lease_starting.notify_all()
        for box in idle:
            self._drop(box)
        if not wait:
            return
        self._spare_work.shutdown(wait=True)  # a spare not begun yet finds itself dropped and goes at once
        self._work.shutdown(wait=True)
        with self._lock:
            unused = [box for box in self._boxes if box.dropped]
        for box in unused:  # whatever a race left: nobody holds them
            self._remove(box)

    # ---- containers ----

    def _open(self, config: SandboxConfig, prepare, gap: SandboxPhase) -> Lease:
        key, now = _key(config), time.time()
        with self._lock:
            if self._closed:
                raise SandboxError("the sandbox pool is closed (the run is stopping)")
            self._leased_at[key] = now
            box = _take_begun(self._idle.get(key))
            if box is None:
                box = self._new_box(config)
                self._misses += 1
                self._submit(self._start, box)
            else:
                self._hits += 1
            self._leased += 1
        self._refill(key, config)
        ready = box.started if prepare is None else self._submit(self._prepared, box, prepare)
        if not ready.done():
            with self._lock:
                self._lease_starts += 1
            ready.add_done_callback(self._lease_ready)
        return Lease(self, box, now, ready, gap)

    def _lease_ready(self, _: Future) -> None:
        with self._lock:
            self._lease_starts -= 1
            self._no_lease_starting.notify_all()

    def _start_spare(self, box: _Box) -> None:
        with self._lock:  # episodes first (see the module docstring)
            self._no_lease_starting.wait_for(lambda: self._lease_starts == 0 or self._closed, SPARE_DEFER_S)
        self._start(box)

    def _submit(self, fn, *args) -> Future:
        """`fn(*args)` in the background; once the pool has closed, a failed Future (the run is stopping)."""
        try:
            return self._work.submit(fn, *args)
        except RuntimeError:  # shut down between a lease's check and here
            failed: Future = Future()
            failed.set_exception(SandboxError("the sandbox pool is closed (the run is stopping)"))
            return failed

    def _new_box(self, config: SandboxConfig) -> _Box:
        """A container on the lowest free lane (not started); the caller holds the lock."""
        lane = next((i for i, taken in enumerate(self._lanes) if not taken), len(self._lanes))
        if lane == len(self._lanes):
            self._lanes.append(True)
        self._lanes[lane] = True
        box = _Box(Sandbox(config, self.client), lane)
        self._boxes.add(box)
        return box

    def _refill(self, key: str, config: SandboxConfig) -> None:
        """Start spares of `config` until it has `spares` of them; past `2 * spares` in all, the spares of the
        kind leased least recently make room."""
        started, evicted = [], []
        with self._lock:
            queue = self._idle.setdefault(key, deque())
            while not self._closed and len(queue) < self.spares:
                if sum(len(q) for q in self._idle.values()) >= 2 * self.spares:
                    others = [k for k, q in self._idle.items() if q and k != key]
                    if not others:
                        break
                    evicted.append(self._idle[min(others, key=self._leased_at.__getitem__)].popleft())
                box = self._new_box(config)
                queue.append(box)
                started.append(box)
        for box in evicted:
            self._drop(box)
        for box in started:
            try:
                self._spare_work.submit(self._start_spare, box)
            except RuntimeError:  # the pool has closed
                self._forget(box)

    def _start(self, box: _Box) -> None:
        with box.lock:
            if box.dropped:  # a spare evicted or the pool closed before its turn came
                box.removed = True
                self._forget(box)
                return
            box.began = True
        began = time.time()
        try:
            box.sandbox.start()
        except Exception as e:  # noqa: BLE001 - the lease that uses it raises it (DockerUnavailable too)
            self._forget(box)
            box.started.set_exception(e if isinstance(e, SandboxError) else SandboxError(f"{type(e).__name__}: {e}"))
            return
        box.ready_at = time.time()
        box.add(SandboxPhase.START, began, box.ready_at)
        box.started.set_result(box.sandbox)
        with box.lock:
            dropped = box.dropped
        if dropped:
            self._remove(box)

    def _prepared(self, box: _Box, prepare: Callable[[Sandbox], None]) -> Sandbox:
        sandbox = box.started.result(timeout=START_TIMEOUT_S)
        began = time.time()
        try:
            prepare(sandbox)
        finally:
            box.add(SandboxPhase.START, began, time.time())
        return sandbox

    def _drop(self, box: _Box) -> None:
        """Nobody will use `box`: remove it now if it has started, else once its start is done."""
        with box.lock:
            box.dropped = True
            started = box.started.done()
        if started:
            try:
                self._work.submit(self._remove, box)
            except RuntimeError:  # the pool has closed: no more background work
                self._remove(box)

    def _remove(self, box: _Box) -> None:
        with box.lock:
            if box.removed:
                return
            box.removed = True
        box.sandbox.close()  # never raises for a container that is gone
        self._forget(box)

    def _forget(self, box: _Box) -> None:
        """`box` holds no container any more: its lane is free, and no lease may take it (a spare that failed)."""
        with self._lock:
            self._lanes[box.index] = False
            self._boxes.discard(box)
            for queue in self._idle.values():
                if box in queue:
                    queue.remove(box)

    def _release(self, box: _Box) -> None:
        with self._lock:
            self._leased -= 1
        self._drop(box)


class Lease:
    """A container leased from the pool, usable as a `CommandRunner`: a command waits for what is left of the
    container's start. Spans it records: each command (`tool`), and what `marked` names."""

    def __init__(self, pool: SandboxPool, box: _Box, start: float, ready: Future, gap: SandboxPhase) -> None:
        self.lane = box.lane
        self.name = box.sandbox.name
        self.waited_s = 0.0  # blocked waiting for the container's start (and checkout)
        self.spans: list[Span] = []  # once the lease has ended: the container's spans up to then, gaps filled
        self._pool, self._box, self._start, self._ready, self._gap = pool, box, start, ready, gap
        if box.ready_at is not None and box.ready_at < start:
            box.add(SandboxPhase.SPARE, box.ready_at, start)

    def sandbox(self) -> Sandbox:
        """The started container, its checkout in; raises SandboxError where the start failed."""
        if not self._ready.done():
            began = time.monotonic()
            try:
                futures.wait([self._ready], timeout=START_TIMEOUT_S)
            finally:
                self.waited_s += time.monotonic() - began
            if not self._ready.done():
                raise SandboxError(f"sandbox {self.name} did not start in {START_TIMEOUT_S:g} s")
        error = self._ready.exception()
        if error is None:
            return self._ready.result()
        if isinstance(error, SandboxError):
            raise error
        raise SandboxError(f"sandbox {self.name}: copying the checkout in failed: {type(error).__name__}: {error}")

    def exec(self, cmd: str, timeout_s: float | None = None, workdir: str | None = None) -> ExecResult:
        sandbox = self.sandbox()
        with self.marked(SandboxPhase.TOOL):
            return sandbox.exec(cmd, timeout_s, workdir)

    @contextmanager
    def marked(self, kind: SandboxPhase) -> Iterator[None]:
        """Record the `with` block as a span of `kind` on this lease's lane."""
        began = time.time()
        try:
            yield
        finally:
            self._box.add(kind, began, time.time())

    def _end(self) -> None:
        end = time.time()
        with self._box.lock:
            spans = list(self._box.spans)
        self.spans = _with_gaps(spans, self._start, end, self._gap, self.lane)
        self._pool._release(self._box)


class EpisodeSandboxes:
    """One episode's workspace and grader from the pool (`workspace(task)`, `grader(task, patch)`, the seams of
    `rollout.play`), and what its containers did: `spans`, and the seconds it waited for them to start."""

    def __init__(self, pool: SandboxPool, image: str | None, grader: DockerGraderConfig) -> None:
        self.pool, self.image = pool, image
        self.grader = PooledGrader(pool, grader, self)
        self.spans: list[Span] = []
        self.agent_wait_s = 0.0  # the agent's commands blocked on its workspace's start
        self.grader_wait_s = 0.0  # the grader blocked on its container's start

    @property
    def wait_s(self) -> float:
        return self.agent_wait_s + self.grader_wait_s

    @contextmanager
    def workspace(self, task: Instance) -> Iterator[Lease]:
        """A leased container with `task`'s checkout at /testbed (as `grading.docker_workspace`), commands there."""
        from swebench_env.images import task_image

        config = SandboxConfig(
            image=task_image(task, self.image, client=self.pool.client), workdir=TESTBED, labels=AGENT_ROLE
        )
        prepare = functools.partial(_prepare_workspace, task)
        lease = None
        try:
            with self.pool.lease(config, prepare, SandboxPhase.MODEL) as lease:
                yield lease
        finally:
            if lease is not None:
                self.agent_wait_s += lease.waited_s
                self.spans += lease.spans


class PooledGrader(DockerGrader):
    """`DockerGrader` whose fresh container is leased from the pool (a spare where there is one), with its test
    run recorded as a `test_run` span. One an episode (it keeps the lease of the grading under way)."""

    def __init__(self, pool: SandboxPool, config: DockerGraderConfig, sandboxes: EpisodeSandboxes) -> None:
        super().__init__(config, pool.client)
        self._pool, self._sandboxes = pool, sandboxes
        self._lease: Lease | None = None

    @contextmanager
    def _sandbox(self, task: Instance) -> Iterator[Sandbox]:
        # DockerGrader's sandbox, but for the instance label (see the docstring)
        config = self.config.sandbox(self._image(task), task, GRADER_ROLE)
        lease = None
        try:
            with self._pool.lease(config, None, SandboxPhase.START) as lease:
                self._lease = lease
                yield lease.sandbox()
        except SandboxError as e:
            raise GradingError(f"instance {task.instance_id!r}: the sandbox failed: {e}") from e
        finally:
            self._lease = None
            if lease is not None:
                self._sandboxes.grader_wait_s += lease.waited_s
                self._sandboxes.spans += lease.spans

    def _run(self, sandbox: Sandbox, task: Instance, patch: str, script: str) -> str:
        if self._lease is None:
            return super()._run(sandbox, task, patch, script)
        with self._lease.marked(SandboxPhase.TEST_RUN):
            return super()._run(sandbox, task, patch, script)


def _prepare_workspace(task: Instance, sandbox: Sandbox) -> None:
    """The checkout at /testbed (an official task's image has it) and the command runner for the agent."""
    if not is_official(task):
        copy_in(sandbox, checkout_archive(task), TESTBED)
    sandbox.start_shell()


def _take_begun(queue: deque[_Box] | None) -> _Box | None:
    """The oldest spare whose start has begun (a lease does not wait for a spare still queued to start)."""
    for box in queue or ():
        if box.began:
            queue.remove(box)
            return box
    return None


def _key(config: SandboxConfig) -> str:
    """Which spares can serve a lease: those of an equal config."""
    return json.dumps(asdict(config), sort_keys=True, default=str)


def _with_gaps(spans: list[Span], start: float, end: float, gap: SandboxPhase, lane: str) -> list[Span]:
    """`spans` in time order, clipped to `end`, with what no span covers within [start, end] as `gap` spans."""
    out: list[Span] = []
    cursor = start
    for span in sorted(spans, key=lambda s: (s.start, s.end)):
        if span.start >= end:
            continue
        if span.start - cursor > MIN_GAP_S:
            out.append(Span(lane, gap, cursor, span.start))
        out.append(Span(lane, span.kind, span.start, min(span.end, end)))
        cursor = max(cursor, span.end)
    if end - cursor > MIN_GAP_S:
        out.append(Span(lane, gap, cursor, end))
    return out
