"""Where a request goes: the simulator's router in front of its engines, and the queue of requests none takes yet.

A request goes to the engine that ran its sample's previous turn if it fits there (its prefix cache), else to
an idle engine, else round robin; with `rollout.affinity_slack` as the runtime's trajectory manager routes
instead (`Router.least_loaded`). A request no engine takes waits in one queue, first come first served, and
engines pull from it when they have room (`take_for`), an equal share each when several pull at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from sim.engine import SimEngine
from sim.workload import Sample


class Router:
    def __init__(self, engines: dict[str, SimEngine], affinity_slack: int | None) -> None:
        """`engines` by name, in index order (an engine's `index` is its place here)."""
        self.engines = engines
        self.queue: deque[Sample] = deque()
        self._by_index = list(engines.values())
        self._rr = 0
        self._served = [0] * len(self._by_index)  # requests routed to each engine (rollout.affinity_slack)
        self._affinity: dict[int, SimEngine] = {}  # group id -> the engine of its last request (the same)
        self._affinity_slack = affinity_slack  # read once: routing runs for every request
        self._idle: dict[str, SimEngine] = {}  # accepting engines with nothing to run, in idle order

    def engine_idle(self, engine: SimEngine) -> None:
        self._idle[engine.name] = engine

    def engine_busy(self, engine: SimEngine) -> None:
        self._idle.pop(engine.name, None)

    def route(self, sample: Sample, now: float) -> None:
        """Route a request: its previous engine if it fits there, else round-robin; queue if none fits.
        When requests are already queued the newcomer queues behind them (engines pull in order)."""
        if not self.queue:
            engine = self._choose(sample)
            if engine is not None:
                engine.offer(sample, now)
                return
        sample.where = "queue"
        self.queue.append(sample)

    def requeue(self, samples: list[Sample]) -> None:
        """Requests handed back by a preempted engine: at the front of the queue, in their order."""
        for sample in reversed(samples):
            sample.engine, sample.where = None, "queue"
            self.queue.appendleft(sample)

    def forget(self, gone: set[Sample]) -> None:
        """Take these requests out of the queue (they restart elsewhere)."""
        self.queue = deque(s for s in self.queue if s not in gone)

    def _choose(self, sample: Sample) -> SimEngine | None:
        """Previous engine (prefix cache) if it fits, else an idle engine, else round-robin; or, with
        `rollout.affinity_slack`, as the runtime's router (`least_loaded`)."""
        if self._affinity_slack is not None:
            return self.least_loaded(sample, self._affinity_slack)
        if sample.engine is not None:
            engine = self._by_index[sample.engine]
            if engine.accepting and engine.fits(sample):
                return engine
        for engine in self._idle.values():
            if engine.accepting:
                return engine
        n = len(self._by_index)
        for k in range(n):
            engine = self._by_index[(self._rr + k) % n]
            if engine.accepting and engine.fits(sample):
                self._rr = (self._rr + k + 1) % n
                return engine
        return None

    def least_loaded(self, sample: Sample, slack: int) -> SimEngine | None:
        """The runtime's router (reference/manager/router.py): the engine with the fewest requests sent to it and
        not finished (then the fewest served), unless the engine of the group's last request holds at most `slack`
        more (a group is one session there; its samples share a prompt). None if no engine can take it."""
        candidates = [e for e in self._by_index if e.accepting and e.fits(sample)]
        if not candidates:
            return None
        least = min(candidates, key=lambda e: (e.num_routed, self._served[e.index]))
        sticky = self._affinity.get(sample.group_id)
        if sticky is not None and sticky in candidates and sticky.num_routed <= least.num_routed + slack:
            choice = sticky
        else:
            choice = self._affinity[sample.group_id] = least
        self._served[choice.index] += 1
        return choice

    def fair_share(self, engines: int) -> int:
        """Queued requests each of `engines` engines that take work at once may pull: the first one
        pulling all that fits would pile the queue onto one engine and leave the others idle."""
        return -(-len(self.queue) // max(1, engines))

    def kick(self, names: Iterable[str], now: float) -> None:
        """Let accepting engines pull queued work (after capacity appeared), an equal share each.
        `names` may be a generator: with nothing queued it is never walked (a preemption would
        otherwise scan every engine, and preemptions grow with the cluster)."""
        if not self.queue:
            return
        names = [name for name in names if self.engines[name].accepting]
        share = self.fair_share(len(names))
        for name in names:
            engine = self.engines[name]
            for sample in self.take_for(engine, share):
                engine.offer(sample, now)

    def take_for(self, engine: SimEngine, limit: int | None = None) -> list[Sample]:
        """Pull queued requests that fit into `engine` (at most `limit`), oldest first (FCFS, no skipping)."""
        taken: list[Sample] = []
        queue = self.queue
        if not queue:
            return taken
        reserve, active = 0, engine.num_active
        while queue and (limit is None or len(taken) < limit):
            head = queue[0]
            if active + len(taken) >= engine.max_seqs:
                break
            final = head.final_context
            if engine.kv_reserved + reserve + final > engine.kv_capacity:
                break
            taken.append(queue.popleft())
            reserve += final
        return taken
