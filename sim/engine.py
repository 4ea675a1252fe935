"""A simulated inference engine: continuous batching over a KV cache, event by event.

The engine never steps token by token. While its batch is unchanged the decode step time is a
closed-form function of the step index (see `sim.cost`), and so is the number of KV blocks it holds
(`BlockLedger`), so it schedules one wake-up at the next event: a request completion, the step at
which the cache runs out of blocks, or the end of a step that carries a prefill chunk. A request that
arrives meanwhile joins at the next step boundary, as in vLLM.

KV memory, `rollout.kv_allocation`:
- `paged`, what vLLM and SGLang do. The cache is a pool of `kv_block_tokens`-token blocks. A request is
  admitted when the blocks of its prompt are free, and gains a block each time its context fills the
  last one. When a step needs a block and none is free, the most recently admitted request is
  preempted by recompute (vLLM V1's `Scheduler.schedule`: `self.running.pop()`): its blocks are freed,
  it goes back to the front of the waiting queue with the tokens it generated, and when admitted again
  it prefills prompt and generated tokens anew, then decodes the rest. A step that preempted admits
  nobody. Each step computes at most `max_num_batched_tokens` tokens: one per decoding request, the
  rest prefill chunks, oldest admission first (chunked prefill). With `prefix_caching` the samples of
  a GRPO group share the full blocks of their prompt: prefilled once on an engine, held once while
  any of the group runs there (vLLM's automatic prefix caching; the hit stops short of the prompt's
  last token, which is recomputed for its logits).
- `reserve`: admission reserves each request's final context (an oracle: the engine never runs out
  of cache mid-request, so it runs fewer sequences at once when lengths are long-tailed); a request's
  whole prefill runs before the next decode step, and groups share nothing.
With memory and budget too large to bind and prefix caching off, the two give the same timeline.
The router (sim/routing.py: `Router.take_for`, `fits`) sends a paged engine up to max_num_seqs requests whatever
its memory, like a load balancer in front of vLLM servers; those it cannot start yet wait in its own
queue. Preemptions and the tokens they recompute are the run's `kv_preemptions` and
`recomputed_tokens` counters.

Simplifications of the paged model: a request takes the blocks of its whole prompt when admitted (V1
takes those of each chunk as it is scheduled); a step's cost is its prefill chunk's plus its decode
step's (`sim.cost`), and a request whose prefill ends in a step also decodes its first token there;
the blocks a preempted request freed are assumed reused, so it re-prefills everything but the
group's shared prompt. The pool is the cache estimate rounded up to whole blocks.

Pausing keeps every request and its tokens; after a weight update `resume` re-prefills each one
under the new weights (partial rollout). Preempting hands the requests back to the simulator.

An engine sees the simulation only through `EngineOwner`: its clock, the queue it pulls from and where it
reports tokens, phases and finished turns (tests/sim/test_engine_timeline.py drives one with a small fake).
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter, deque
from collections.abc import Callable
from itertools import count
from typing import Protocol

from sim.config import RolloutConfig
from sim.cost import CostModel
from sim.host import HostShare
from sim.kv_blocks import NEVER, BlockLedger
from sim.workload import Sample


class EngineState(enum.Enum):
    OFF = "off"  # the resource is not rollout-active (training, switching)
    IDLE = "idle"  # accepting, nothing to run
    RUNNING = "running"
    PAUSED = "paused"  # holding requests, not generating
    SYNCING = "syncing"


class Seq:
    """An admitted request's state on its engine."""

    __slots__ = ("mark", "offset", "ticket", "hit", "prefilled", "target", "blocks", "shared")

    def __init__(self, hit: int = 0, target: int = 0, blocks: int = 0, shared: int = 0) -> None:
        self.mark = 0  # decoding: step at which its tokens were last counted
        self.offset = 0  # decoding: its context is offset + engine step
        self.ticket = 0  # identifies its live entry in the completion heap
        self.hit = hit  # prefix tokens found in the cache at admission
        self.prefilled = hit  # paged: prefix tokens whose KV is computed
        self.target = target  # paged: prefix tokens to prefill
        self.blocks = blocks  # paged, while prefilling: blocks it holds itself
        self.shared = shared  # paged: its group's prompt blocks it uses without holding


class EngineOwner(Protocol):
    """What an engine needs from the simulation it runs in (sim/runner.py's `Simulation`; a test's fake)."""

    counters: Counter[str]  # the run's counters: prefill_tokens, kv_preemptions, recomputed_tokens
    host: HostShare | None  # the host's work on the devices' cores (cluster.host_cores set), else None

    def now(self) -> float:
        """Simulated seconds."""

    def wake(self, delay: float, fn: Callable, *args) -> None:
        """Call fn(*args) after `delay` simulated seconds (ties: in the order asked)."""

    def add_tokens(self, resource: str, tokens: int) -> None:
        """`tokens` generated on `resource`, for its current timeline interval."""

    def engine_busy(self, engine: SimEngine, now: float) -> None:
        """The engine started generating, or its batch thinned out or filled up again."""

    def engine_idle(self, engine: SimEngine, now: float) -> None:
        """The engine has nothing left to run."""

    def take_for(self, engine: SimEngine, limit: int | None = None) -> list[Sample]:
        """Queued requests for the engine to take now (at most `limit`), oldest first."""

    def turn_done(self, engine: SimEngine, sample: Sample) -> None:
        """The engine finished the sample's current turn."""

    def host_slowdown(self) -> float:
        """How many times longer a generating device's work started now takes (1 without `host`)."""

    def host_share_changed(self) -> None:
        """The engine's demand on the host's cores changed."""


class SimEngine:
    def __init__(
        self,
        sim: EngineOwner,
        name: str,
        index: int,
        kv_capacity: int,
        max_seqs: int,
        state: EngineState,
        cost: CostModel,
        rollout: RolloutConfig,
        prefix_cache_hit: float = 0.0,
    ) -> None:
        """`cost`: the cost model of the device this engine runs on (its decode and prefill speed); `rollout`:
        how it schedules (rollout.*); `prefix_cache_hit`: the share of a returning agent turn's context still in
        its prefix cache (workload.prefix_cache_hit)."""
        self.sim, self.name, self.index, self.cost = sim, name, index, cost
        self.prefix_cache_hit = prefix_cache_hit
        self.max_seqs = max_seqs
        self.state = state
        self.version = 0
        self.steps = 0  # decode steps done since the start
        self.batch: dict[Sample, Seq] = {}  # decoding requests, in admission order
        self._heap: list[tuple[int, int, Sample]] = []  # (step at which it finishes, ticket, sample)
        self._ctx_base = 0  # sum of contexts = _ctx_base + len(batch) * steps
        self._pending: list[Sample] = []  # joins waiting for the next step boundary
        self.held: list[Sample] = []  # paused requests awaiting resume
        self._t0 = 0.0  # when decoding of the current stretch starts (after its prefill)
        self._planned = 0  # steps until the next event
        self._epoch = 0  # invalidates stale wake-ups
        self._tiebreak = count()
        self._sparse_below = max(2, max_seqs // 8)  # fewer running sequences than this: a thin batch
        self._sparse = False
        r = rollout
        self.paged = r.kv_allocation == "paged"
        # The reservation ledger the router reads (`Router.take_for`, `fits`). A paged engine
        # reserves nothing ahead, so its ledger never refuses: max_num_seqs bounds what it is sent.
        self.kv_reserved = 0
        self.kv_capacity = NEVER if self.paged else kv_capacity
        # Paged state.
        self.block_tokens = r.kv_block_tokens
        self.kv_blocks = BlockLedger(-(-kv_capacity // r.kv_block_tokens), r.kv_block_tokens)
        self.kv_peak_blocks = 0  # most blocks any step needed
        self.token_budget = r.max_num_batched_tokens
        self.prefix_caching = self.paged and r.prefix_caching
        self.prefilling: dict[Sample, Seq] = {}  # admitted, prefill not done, in admission order
        self.waiting: deque[Sample] = deque()  # sent here, not admitted; preempted ones at the front
        self._groups: dict[int, int] = {}  # group id -> its requests holding the shared prompt here
        self._lost: dict[Sample, int] = {}  # preempted -> KV tokens it had computed (to recompute)
        self._room = 0  # prefill tokens the current step can still take
        self._short_at = 0  # as of the last plan: no step before this one is short of blocks
        self._preempted_now = False  # the current step preempted: it admits nobody
        # The host's work on the devices' cores (sim/host.py): this stretch's slowdown and the cores of host
        # work its tokens need at full speed (both stay 1 and 0 without cluster.host_cores).
        self._slow = 1.0
        self.host_demand = 0.0

    # ---- capacity ----

    @property
    def accepting(self) -> bool:
        state = self.state
        return state is EngineState.IDLE or state is EngineState.RUNNING

    @property
    def active(self) -> dict[Sample, Seq] | list[Sample]:
        """Requests this engine holds for generation: decoding, prefilling or waiting for blocks. The
        router counts them against max_num_seqs; a role switch needs none left."""
        if not self.prefilling and not self.waiting:
            return self.batch
        return [*self.batch, *self.prefilling, *self.waiting]

    @property
    def num_active(self) -> int:
        """len(self.active), without building the list."""
        return len(self.batch) + len(self.prefilling) + len(self.waiting)

    @property
    def num_routed(self) -> int:
        """Requests sent here and not finished: held for generation, or offered and not yet admitted."""
        return len(self.batch) + len(self.prefilling) + len(self.waiting) + len(self._pending)

    def fits(self, sample: Sample) -> bool:
        seqs = self.num_routed
        if self.paged:
            return seqs < self.max_seqs
        return seqs < self.max_seqs and self.kv_reserved + sample.final_context <= self.kv_capacity

    def cached_prefix(self, sample: Sample) -> int:
        """Tokens of a returning agent turn still in this engine's prefix cache."""
        if sample.engine != self.index or sample.turn == 0 or sample.generated:
            return 0
        return int(sample.context * self.prefix_cache_hit)

    @property
    def sum_ctx(self) -> int:
        return self._ctx_base + len(self.batch) * self.steps

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
                else self.cost.decode_steps_within(len(self.batch), self.sum_ctx, elapsed / self._slow, self._planned)
            )
        if steps:
            self.steps += steps
            self.sim.add_tokens(self.name, steps * len(self.batch))
        if now > self._t0:
            self._t0 = now

    def _plan(self, now: float) -> None:
        self._epoch += 1
        if not self.batch and not self.prefilling:
            assert not self.waiting, f"{self.name}: requests wait for blocks with none in use"
            self.state = EngineState.IDLE
            self.sim.engine_idle(self, now)
            return
        batch = len(self.batch)
        sparse = batch < self._sparse_below
        if self.state is not EngineState.RUNNING or sparse != self._sparse:
            # A new timeline interval whenever the batch thins out or fills up again, so the picture
            # and the metrics can tell a full engine from one decoding a few stragglers.
            self.state, self._sparse = EngineState.RUNNING, sparse
            self.sim.engine_busy(self, now)
        planned = self._planned = self._steps_to_next_event()
        dt = self.cost.decode_run_s(batch, self._ctx_base + batch * self.steps, planned)
        if self.sim.host is not None:
            self.host_demand = self.sim.host.demand(batch * planned / dt) if dt > 0 else 0.0
            self._slow = self.sim.host_slowdown()
            dt *= self._slow
            self.sim.host_share_changed()  # a training step under way runs at the new share from now on
        self.sim.wake(self._t0 + dt - now, self._on_wake, self._epoch, planned)

    def _steps_to_next_event(self) -> int:
        """Decode steps until a completion, a step short of blocks, or (while prompts are being
        prefilled) the end of this step; 0 for a step that only prefills."""
        finish, step = self._next_finish(), self.steps
        steps = finish - step
        if self.paged:
            blocks = self.kv_blocks
            self._short_at = short = blocks.first_overflow(step, finish)
            if short - step < steps:
                steps = short - step
            if self.prefilling and steps > (1 if self.batch else 0):
                steps = 1 if self.batch else 0
            last = step + steps - 1 if steps > 1 else step  # blocks only grow within a stretch: its last step
            if blocks.base + blocks.decoding * (last // blocks.bs + 1) > self.kv_peak_blocks:  # (a bound)
                self.kv_peak_blocks = max(self.kv_peak_blocks, blocks.needed(last))
                assert self.kv_peak_blocks <= blocks.capacity, (self.name, self.kv_peak_blocks, blocks.capacity)
        return steps

    def _next_finish(self) -> int:
        """Step at which the next decoding request finishes (dropping entries of preempted ones)."""
        heap = self._heap
        if self.paged:
            batch = self.batch
            while heap:
                at, ticket, sample = heap[0]
                seq = batch.get(sample)
                if seq is not None and seq.ticket == ticket:
                    return at
                heapq.heappop(heap)
        return heap[0][0] if heap else NEVER

    def _pop_finished(self) -> list[Sample]:
        """Remove the requests that finish at this step, dropping the entries of preempted ones (no
        live entry finishes before this step)."""
        heap, batch, step, finished = self._heap, self.batch, self.steps, []
        while heap:
            at, ticket, sample = heap[0]
            if self.paged:
                seq = batch.get(sample)
                if seq is None or seq.ticket != ticket:  # preempted since
                    heapq.heappop(heap)
                    continue
            if at != step:
                break
            heapq.heappop(heap)
            finished.append(self._remove(sample))
        return finished

    def _on_wake(self, epoch: int, steps: int) -> None:
        if epoch != self._epoch:
            return
        now = self.sim.now()
        self._advance(now, steps)
        finished = self._pop_finished() if self._heap else ()
        if self.paged:
            self._open_step()
        taken = self.sim.take_for(self)
        if taken or self._pending or self.prefilling or self.waiting:  # else there is nothing to admit
            self._admit(now, self._pending + taken if taken else self._pending)
            self._pending = []
        self._plan(now)
        for sample in finished:
            self.sim.turn_done(self, sample)

    def _on_prefill_end(self, epoch: int) -> None:
        """The boundary after a prefill that requests arrived during: they are prefilled together. Only
        they: the queue is pulled at decode boundaries, as before the prefill."""
        if epoch != self._epoch:
            return
        now = self.sim.now()
        if self.paged:
            self._open_step()
        self._admit(now, self._pending)
        self._pending = []
        self._plan(now)

    # ---- requests in and out ----

    def offer(self, sample: Sample, now: float) -> None:
        """Take a request (the caller checked `fits`); it joins at the next step boundary: at once on an
        idle engine, at the end of a prefill under way (with whatever else arrives meanwhile, in one
        forward, as an engine's scheduler batches the requests that queued during a step), else after
        the decode step under way."""
        if self.state is EngineState.IDLE:
            if self.paged:
                self._open_step()
            self._advance(now)
            self._admit(now, [sample])
            self._plan(now)
            return
        pending = self._pending
        pending.append(sample)
        sample.where = "engine"
        if not self.paged:
            self.kv_reserved += sample.final_context
        if len(pending) > 1:
            return  # a boundary wake-up is already scheduled
        if now < self._t0:  # a prefill is under way: its end is the next step boundary
            self._epoch += 1
            self.sim.wake(self._t0 - now, self._on_prefill_end, self._epoch)
            return
        batch = len(self.batch)
        ctx = self._ctx_base + batch * self.steps
        done = self.cost.decode_steps_within(batch, ctx, (now - self._t0) / self._slow, self._planned)
        if done + 1 < self._planned:
            self._epoch += 1
            dt = self.cost.decode_run_s(batch, ctx, done + 1) * self._slow
            self.sim.wake(self._t0 + dt - now, self._on_wake, self._epoch, done + 1)

    def _admit(self, now: float, samples: list[Sample]) -> None:
        """Take `samples` in. Reserve: prefill them as one batch; decoding resumes when the prefill
        ends. Paged: they wait for blocks and the step's token budget (`_schedule`)."""
        if self.paged:
            self._schedule(now, samples)
            return
        new_tokens, pairs = 0, 0.0
        for sample in samples:
            cached = self.cached_prefix(sample)
            new = sample.prefix_tokens - cached
            new_tokens += new
            pairs += new * (cached + new / 2)
            if sample not in self._pending:
                self.kv_reserved += sample.final_context
            sample.engine, sample.where = self.index, "engine"
            self._start_decoding(sample, Seq(cached))
        self._prefill(now, new_tokens, pairs)

    def _prefill(self, now: float, tokens: int, pairs: float) -> None:
        """A prefill of `tokens` tokens (one forward, whatever the requests): its compute or weight reads,
        and its fixed cost (`costs.prefill_overhead_s`)."""
        if tokens:
            self.sim.counters["prefill_tokens"] += tokens
            seconds = self.cost.prefill_s(tokens, pairs)
            if self.cost.prefill_overhead_s:
                seconds += self.cost.prefill_overhead_s
            if self.sim.host is not None:
                seconds *= self.sim.host_slowdown()
            self._t0 = max(self._t0, now) + seconds

    def _start_decoding(self, sample: Sample, seq: Seq) -> None:
        """Add a request whose prefill is done to the batch: it decodes from this step on."""
        step = self.steps
        seq.mark, seq.offset, seq.ticket = step, sample.prefix_tokens - step, next(self._tiebreak)
        self.batch[sample] = seq
        self._ctx_base += seq.offset
        heapq.heappush(self._heap, (step + sample.remaining, seq.ticket, sample))
        if self.paged:
            self.kv_blocks.base -= seq.blocks
            self.kv_blocks.add_decoding(seq.offset, seq.shared)

    def _remove(self, sample: Sample) -> Sample:
        seq = self.batch.pop(sample)
        sample.add_tokens(self.version, self.steps - seq.mark)
        self._ctx_base -= seq.offset
        if self.paged:
            self.kv_blocks.add_decoding(seq.offset, seq.shared, sign=-1)
            self._release_prompt(sample, seq)
        else:
            self.kv_reserved -= sample.final_context
        return sample

    # ---- paged: steps, admission, preemption ----

    def _open_step(self) -> None:
        """A step boundary: give every admitted request the block for its next token, preempting the
        most recently admitted ones while the cache is short, and open the step's token budget."""
        self._preempted_now = False
        if self.steps >= self._short_at:  # else only completions came since the plan that found it
            while self.kv_blocks.needed(self.steps) > self.kv_blocks.capacity:
                self._preempt_last()
                self._preempted_now = True
        self._room = self.token_budget - len(self.batch)

    def _preempt_last(self) -> None:
        """Preemption by recompute of the most recently admitted request (vLLM V1's default)."""
        assert len(self.batch) + len(self.prefilling) > 1, f"{self.name}: a lone request outgrew the cache"
        if self.prefilling:
            sample = next(reversed(self.prefilling))
            seq = self.prefilling.pop(sample)
            self.kv_blocks.base -= seq.blocks
            self._release_prompt(sample, seq)
            computed = seq.prefilled
        else:
            sample = next(reversed(self.batch))
            seq = self.batch[sample]
            self._remove(sample)
            computed = sample.prefix_tokens
        self._lost[sample] = self._lost.get(sample, 0) + computed - seq.hit
        self.waiting.appendleft(sample)
        self.sim.counters["kv_preemptions"] += 1

    def _schedule(self, now: float, samples: list[Sample]) -> None:
        """Fill the step's token budget: continue prefills, then admit waiting requests in order while
        the budget, max_num_seqs and free blocks allow (none after a preemption), as vLLM V1 does."""
        waiting = self.waiting
        if samples:
            for sample in samples:
                sample.where = "engine"
            waiting.extend(samples)
        tokens, pairs = 0, 0.0
        for sample, seq in list(self.prefilling.items()) if self.prefilling else ():
            if self._room <= 0:
                break
            t, p = self._chunk(sample, seq)
            tokens, pairs = tokens + t, pairs + p
        if waiting and self._room > 0 and not self._preempted_now:
            used, capacity = self.kv_blocks.needed(self.steps), self.kv_blocks.capacity
            while waiting and self._room > 0 and len(self.batch) + len(self.prefilling) < self.max_seqs:
                seq, blocks = self._lookup(waiting[0])
                if used + blocks > capacity:
                    break
                used += blocks
                sample = waiting.popleft()
                self._hold(sample, seq)
                t, p = self._chunk(sample, seq)
                tokens, pairs = tokens + t, pairs + p
        if tokens:
            self._prefill(now, tokens, pairs)

    def _lookup(self, sample: Sample) -> tuple[Seq, int]:
        """The request's state if admitted now, and the blocks admitting it takes: its prompt and
        the slot of its next token, less the full blocks of its group's prompt when those are held
        here already (then they are also a cache hit)."""
        bs = self.block_tokens
        hit, shared = self.cached_prefix(sample), 0
        if self.prefix_caching:
            shared = (sample.turns[0].input_tokens - 1) // bs  # full blocks before the prompt's last token
        prefix = sample.prefix_tokens
        own = -(-(prefix + 1) // bs) - shared
        if shared and self._groups.get(sample.group_id):
            return Seq(max(hit, shared * bs), prefix, own, shared), own
        return Seq(hit, prefix, own, shared), own + shared

    def _hold(self, sample: Sample, seq: Seq) -> None:
        """Admit: the request takes its blocks (its group's prompt blocks if it is the first) and
        starts prefilling."""
        if seq.shared:
            held = self._groups.get(sample.group_id, 0)
            if not held:
                self.kv_blocks.base += seq.shared
            self._groups[sample.group_id] = held + 1
        self.kv_blocks.base += seq.blocks
        sample.engine = self.index
        self.prefilling[sample] = seq

    def _release_prompt(self, sample: Sample, seq: Seq) -> None:
        if not seq.shared:
            return
        held = self._groups.pop(sample.group_id) - 1
        if held:
            self._groups[sample.group_id] = held
        else:
            self.kv_blocks.base -= seq.shared

    def _chunk(self, sample: Sample, seq: Seq) -> tuple[int, float]:
        """Prefill as much of the request as the step's budget has room for: (tokens, attention
        pairs); a request whose prefill completes starts decoding in this step."""
        take = min(self._room, seq.target - seq.prefilled)
        pairs = take * (seq.prefilled + take / 2)
        seq.prefilled += take
        self._room -= take
        lost = self._lost.pop(sample, 0)
        if lost:
            self.sim.counters["recomputed_tokens"] += min(lost, take)
        if seq.prefilled < seq.target:
            if lost > take:
                self._lost[sample] = lost - take
        else:
            del self.prefilling[sample]
            self._start_decoding(sample, seq)
        return take, pairs

    # ---- pause, sync, resume ----

    def _drain(self, now: float) -> list[Sample]:
        """Stop at the current step boundary and release every request, tokens counted."""
        self._advance(now)
        out = [self._remove(s) for s in list(self.batch)]
        for sample, seq in self.prefilling.items():
            self.kv_blocks.base -= seq.blocks
            self._release_prompt(sample, seq)
            out.append(sample)
        out += self.waiting
        out += self._pending
        for sample in self._pending:
            if not self.paged:
                self.kv_reserved -= sample.final_context
        self._heap, self._pending, self._epoch = [], [], self._epoch + 1
        self.prefilling, self.waiting, self._lost = {}, deque(), {}
        assert self.kv_reserved == 0 and self._ctx_base == 0, (self.kv_reserved, self._ctx_base)
        assert self.kv_blocks.empty and not self._groups, (self.kv_blocks.base, self._groups)
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
        if self.paged:
            self._open_step()
        self._admit(now, held + self.sim.take_for(self, limit))
        self._plan(now)
