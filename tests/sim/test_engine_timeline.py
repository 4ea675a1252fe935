"""One engine's timeline, driven through `EngineOwner` (sim/engine.py) by a small owner that logs every call.

The engine runs on a real cost model of a device so fast that the roofline's terms vanish next to the fixed
overheads (`costs.decode_step_overhead_s` = 1 s a step, `costs.prefill_overhead_s` = 0.5 s a prefill), so the
timeline reads in whole steps: the whole event log is asserted, as SimPy's own tests do.
"""

from __future__ import annotations

from collections import Counter, deque

import simpy

from core import specs
from core.specs import DeviceSpec
from sim.config import load_config
from sim.cost import CostModel
from sim.engine import EngineOwner, EngineState, SimEngine
from sim.runner import Simulation
from sim.workload import Sample, Turn

# Peaks so high that a prefill's or a decode step's roofline seconds (below 1e-19) round away against 0.5 s and 1 s.
INSTANT = DeviceSpec("instant", "no roofline time", 1e20, 80.0, 1e20, 1.0, 1.0, 1.0, 8)
COSTS = ("rollout.tensor_parallel=1", "costs.decode_step_overhead_s=1.0", "costs.prefill_overhead_s=0.5")


class LoggingOwner:
    """`EngineOwner` on a SimPy clock: hands out the requests of its own queue and logs what the engine reports."""

    def __init__(self, queue: list[Sample]) -> None:
        self.env = simpy.Environment()
        self.counters: Counter[str] = Counter()
        self.host = None
        self.queue = deque(queue)
        self.log: list[tuple] = []

    def now(self) -> float:
        return self.env.now

    def wake(self, delay, fn, *args) -> None:
        self.env.timeout(max(0.0, delay)).callbacks.append(lambda _: fn(*args))

    def add_tokens(self, resource: str, tokens: int) -> None:
        self.log.append((self.now(), "tokens", tokens))

    def engine_busy(self, engine: SimEngine, now: float) -> None:
        self.log.append((now, "busy", len(engine.batch)))

    def engine_idle(self, engine: SimEngine, now: float) -> None:
        self.log.append((now, "idle"))

    def take_for(self, engine: SimEngine, limit: int | None = None) -> list[Sample]:
        room = engine.max_seqs - engine.num_active
        taken = [self.queue.popleft() for _ in range(min(room, len(self.queue), limit or room))]
        if taken:
            self.log.append((self.now(), "take", [s.index for s in taken]))
        return taken

    def turn_done(self, engine: SimEngine, sample: Sample) -> None:
        self.log.append((self.now(), "done", sample.index))

    def host_slowdown(self) -> float:
        return 1.0

    def host_share_changed(self) -> None:
        pass


def owner_members() -> set[str]:
    """The attributes and methods `EngineOwner` declares."""
    return set(EngineOwner.__annotations__) | {name for name in vars(EngineOwner) if not name.startswith("_")}


def test_the_simulation_and_the_logging_owner_have_what_an_engine_needs(small_config):
    assert owner_members() >= {"now", "wake", "take_for", "turn_done", "counters", "host"}
    for owner in (LoggingOwner([]), Simulation.from_config(small_config("num_steps=1"), "tag")):
        assert {name for name in owner_members() if not hasattr(owner, name)} == set(), type(owner).__name__


def request(index: int, output_tokens: int) -> Sample:
    return Sample(group_id=index, index=index, turns=(Turn(input_tokens=100, output_tokens=output_tokens, wait_s=0.0),))


def test_an_engine_prefills_batches_decodes_and_pulls_at_step_boundaries():
    """s0 arrives at an idle engine and is prefilled at once; s1 arrives during that prefill and joins at its
    end, with a prefill of its own before the two decode; s2 waits in the owner's queue until s0 finishes and
    frees one of the two slots; s1 and s2 finish on the same step, in admission order, and the engine goes
    idle. A prefill holds up the batch's decoding: one forward at a time."""
    s0, s1, s2 = request(0, 3), request(1, 5), request(2, 2)
    owner = LoggingOwner([s2])
    cfg = load_config(overrides=list(COSTS))
    cost = CostModel(cfg, specs.model("qwen3-0.6b"), INSTANT)
    engine = SimEngine(owner, "R00", 0, 100_000, 2, EngineState.IDLE, cost, cfg.rollout)
    engine.offer(s0, 0.0)
    engine.offer(s1, 0.0)
    owner.env.run()
    assert owner.log == [
        (0.0, "busy", 1),  # s0 prefilled 0 - 0.5 s (a thin batch of one)
        (0.5, "busy", 2),  # s1 prefilled 0.5 - 1 s; the batch of two decodes from 1 s
        (4.0, "tokens", 6),  # three steps of two: s0 is done
        (4.0, "take", [2]),  # its slot goes to s2, prefilled 4 - 4.5 s
        (4.0, "done", 0),
        (6.5, "tokens", 4),  # two more steps of two: s1 (5 tokens) and s2 (2) are done
        (6.5, "idle"),
        (6.5, "done", 1),
        (6.5, "done", 2),
    ]
    assert [s.version_tokens for s in (s0, s1, s2)] == [{0: 3}, {0: 5}, {0: 2}]
    assert owner.counters == Counter(prefill_tokens=300)
    assert engine.state is EngineState.IDLE and engine.num_routed == 0
