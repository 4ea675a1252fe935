"""A simulated inference engine: continuous batching over a KV cache, event by event.

The engine never steps token by token. While its batch is unchanged the decode step time is a
closed-form function of the step index (see `sim.cost`), so it schedules one wake-up at the next
request completion. A request that arrives meanwhile joins at the next step boundary, as in vLLM.
Admission reserves each request's final context in the KV cache (an oracle stand-in for vLLM's
incremental allocation with preemption: this engine never runs out of cache mid-request).

Pausing keeps every request and its tokens; after a weight update `resume` re-prefills each one
under the new weights (partial rollout). Preempting hands the requests back to the simulator.
"""

from __future__ import annotations

import enum
import heapq
from itertools import count
from typing import TYPE_CHECKING

from sim.workload import Sample

if TYPE_CHECKING:
    from sim.runner import Simulation


class EngineState(enum.Enum):
    OFF = "off"  # the resource is not rollout-active (training, switching)
    IDLE = "idle"  # accepting, nothing to run
    RUNNING = "running"
    PAUSED = "paused"  # holding requests, not generating
    SYNCING = "syncing"


class SimEngine:
    def __init__(self, sim: Simulation, name: str, index: int, kv_capacity: int, max_seqs: int, state: EngineState):
        self.sim, self.name, self.index = sim, name, index
        self.kv_capacity, self.max_seqs = kv_capacity, max_seqs
        self.state = state
        self.version = 0
        self.steps = 0  # decode steps done since the start
        self.active: dict[Sample, list[int]] = {}  # sample -> [step its tokens were last counted, ctx offset]
        self._heap: list[tuple[int, int, Sample]] = []  # (step at which it finishes, tiebreak, sample)
        self._ctx_base = 0  # sum of contexts = _ctx_base + len(active) * steps
        self.kv_reserved = 0
        self._pending: list[Sample] = []  # joins waiting for the next step boundary
        self.held: list[Sample] = []  # paused requests awaiting resume
        self._t0 = 0.0  # when decoding of the current stretch starts (after its prefill)
        self._s0 = 0  # steps at the start of the stretch
        self._planned = 0  # steps until the next completion
        self._epoch = 0  # invalidates stale wake-ups
        self._tiebreak = count()
        self._sparse_below = max(2, max_seqs // 8)  # fewer running sequences than this: a thin batch
        self._sparse = False

    # ---- capacity ----

    @property
    def accepting(self) -> bool:
        return self.state in (EngineState.IDLE, EngineState.RUNNING)

    def fits(self, sample: Sample) -> bool:
        seqs = len(self.active) + len(self._pending)
        return seqs < self.max_seqs and self.kv_reserved + sample.final_context <= self.kv_capacity

    @property
    def sum_ctx(self) -> int:
        return self._ctx_base + len(self.active) * self.steps

    # ---- the decode clock ----

    def _advance(self, now: float, steps: int | None = None) -> None:
        """Count the decode steps done by `now` (or exactly `steps`) and start a new stretch there."""
        if self.state is not EngineState.RUNNING:
            return
        if steps is None:
            elapsed = now - self._t0
            steps = (
                0
                if elapsed <= 0
                else self.sim.cost.decode_steps_within(len(self.active), self.sum_ctx, elapsed, self._planned)
            )
        if steps:
            self.steps += steps
            self.sim.recorder.add_tokens(self.name, steps * len(self.active))
        self._s0, self._t0 = self.steps, max(now, self._t0)

    def _plan(self, now: float) -> None:
        self._epoch += 1
        if not self.active:
            self.state = EngineState.IDLE
            self.sim.engine_idle(self, now)
            return
        sparse = len(self.active) < self._sparse_below
        if self.state is not EngineState.RUNNING or sparse != self._sparse:
            # A new timeline interval whenever the batch thins out or fills up again, so the picture
            # and the metrics can tell a full engine from one decoding a few stragglers.
            self.state, self._sparse = EngineState.RUNNING, sparse
            self.sim.engine_busy(self, now)
        self._planned = self._heap[0][0] - self.steps
        dt = self.sim.cost.decode_run_s(len(self.active), self.sum_ctx, self._planned)
        self.sim.wake(self._t0 + dt - now, self._on_wake, self._epoch, self._planned)

    def _on_wake(self, epoch: int, steps: int) -> None:
        if epoch != self._epoch:
            return
        now = self.sim.env.now
        self._advance(now, steps)
        finished = []
        while self._heap and self._heap[0][0] == self.steps:
            finished.append(self._remove(heapq.heappop(self._heap)[2]))
        self._admit(now, self._pending + self.sim.take_for(self))
        self._pending = []
        self._plan(now)
        for sample in finished:
            self.sim.turn_done(self, sample)

    # ---- requests in and out ----

    def offer(self, sample: Sample, now: float) -> None:
        """Take a request (the caller checked `fits`); it joins at the next step boundary."""
        if self.state is EngineState.IDLE or now < self._t0:
            self._advance(now)
            self._admit(now, [sample])
            self._plan(now)
            return
        self._pending.append(sample)
        sample.where = "engine"
        self.kv_reserved += sample.final_context
        if len(self._pending) > 1:
            return  # a boundary wake-up is already scheduled
        done = self.sim.cost.decode_steps_within(len(self.active), self.sum_ctx, now - self._t0, self._planned)
        if done + 1 < self._planned:
            self._epoch += 1
            dt = self.sim.cost.decode_run_s(len(self.active), self.sum_ctx, done + 1)
            self.sim.wake(self._t0 + dt - now, self._on_wake, self._epoch, done + 1)

    def _admit(self, now: float, samples: list[Sample]) -> None:
        """Prefill `samples` as one batch; decoding resumes when the prefill ends."""
        new_tokens, pairs = 0, 0.0
        for sample in samples:
            cached = self.sim.cached_prefix(self, sample)
            new = sample.prefix_tokens - cached
            new_tokens += new
            pairs += new * (cached + new / 2)
            if sample not in self._pending:
                self.kv_reserved += sample.final_context
            sample.engine, sample.where = self.index, "engine"
            self.active[sample] = [self.steps, sample.prefix_tokens - self.steps]
            self._ctx_base += sample.prefix_tokens - self.steps
            heapq.heappush(self._heap, (self.steps + sample.remaining, next(self._tiebreak), sample))
        if new_tokens:
            self.sim.counters["prefill_tokens"] += new_tokens
            self._t0 = max(self._t0, now) + self.sim.cost.prefill_s(new_tokens, pairs)

    def _remove(self, sample: Sample) -> Sample:
        mark, offset = self.active.pop(sample)
        sample.add_tokens(self.version, self.steps - mark)
        self._ctx_base -= offset
        self.kv_reserved -= sample.final_context
        return sample

    def _drain(self, now: float) -> list[Sample]:
        """Stop at the current step boundary and release every request, tokens counted."""
        self._advance(now)
        out = [self._remove(s) for s in list(self.active)] + self._pending
        for sample in self._pending:
            self.kv_reserved -= sample.final_context
        self._heap, self._pending, self._epoch = [], [], self._epoch + 1
        assert self.kv_reserved == 0 and self._ctx_base == 0, (self.kv_reserved, self._ctx_base)
        return out

    def preempt(self, now: float) -> list[Sample]:
        out = self._drain(now) + self.held
        self.held = []
        self.state = EngineState.OFF
        return out

    def pause(self, now: float) -> None:
        drained = self._drain(now)
        for sample in drained:
            sample.where = "held"
        self.held += drained
        self.state = EngineState.PAUSED

    def start_sync(self) -> None:
        if self.state is EngineState.RUNNING:
            raise RuntimeError(f"{self.name}: weights must not change while generating; pause first")
        self.state = EngineState.SYNCING

    def finish_sync(self, version: int, now: float) -> None:
        self.version = version
        self.state = EngineState.PAUSED if self.held else EngineState.IDLE
        self._t0 = now

    def resume(self, now: float, limit: int | None = None) -> None:
        """Re-prefill every held request under the current weights, pull up to `limit` queued ones
        and continue."""
        if self.state is not EngineState.PAUSED and self.state is not EngineState.IDLE:
            return
        held, self.held = self.held, []
        self.state = EngineState.IDLE
        self._t0 = now
        for sample in held:
            sample.engine = None  # the KV cache was computed with old weights: prefill it all again
        self._admit(now, held + self.sim.take_for(self, limit))
        self._plan(now)
