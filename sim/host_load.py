"""How busy the host's cores are, on a cluster whose devices are those cores (`cluster.host_cores` set).

The simulation tells it which resources train and when sandboxes work; it reads the engines' states. It
answers how many times longer a device's or a sandbox's work started now takes (sim/host.py's model), and
re-times the training steps under way whenever that changes. Without `cluster.host_cores` nothing is ever
slowed and no step is re-timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sim.config import SimConfig
from sim.engine import EngineState, SimEngine
from sim.host import HostShare, sandbox_rate


@dataclass
class _TrainWork:
    """A training step under way while the host shares the devices' cores: its work left in seconds at full
    speed, re-timed whenever the cores' share changes (`HostLoad.changed`)."""

    step: int
    finish: Callable[[float], None]  # called with the simulated second it ends
    left: float  # seconds of work at full speed, as of `since`
    slow: float  # the slowdown it runs at since `since`
    since: float
    epoch: int = 0  # its latest scheduled end; earlier ones are void


class HostLoad:
    def __init__(
        self,
        cfg: SimConfig,
        devices: dict[str, int],
        engines: list[SimEngine],
        wake: Callable[..., None],
        now: Callable[[], float],
    ) -> None:
        """`devices`: each resource's devices; `engines`: every engine, in index order; `wake` and `now`: the
        simulation's clock (`Simulation.wake`, `Simulation.now`)."""
        self._cfg, self._devices, self._engines, self._wake, self._now = cfg, devices, engines, wake, now
        host_cores = cfg.cluster.host_cores
        self.sandbox_cpu = cfg.workload.sandbox_cpu_cores if host_cores is not None else None
        self._sandbox_ops = 0  # with workload.sandbox_cpu_cores: sandboxes at work now (tool calls, tests, starts)
        w = cfg.workload  # whether sandboxes run slower than alone at all (`sandbox_stretch`): a turn's fast path
        self.sandbox_slowed = host_cores is not None and (
            w.sandbox_busy_stretch != 1.0 or w.sandbox_cpu_cores is not None
        )
        self.share: HostShare | None = None  # None: the host's work costs the devices nothing
        if host_cores is not None and (cfg.costs.host_token_s > 0 or self.sandbox_cpu is not None):
            self.share = HostShare(host_cores, cfg.total_gpus, cfg.costs.host_token_s, cfg.costs.host_train_placement)
        self.training: set[str] = set()  # resources in a training step
        self._train_work: dict[int, _TrainWork] = {}  # with the host sharing cores: steps under way, by step

    def slowdown(self, training: bool = False) -> float:
        """How many times longer a device's work started now takes, the host's work sharing its cores
        (`sim.host`): a training device's (`training`) or a generating or syncing one's; 1 without
        `cluster.host_cores`."""
        if self.share is None:
            return 1.0
        busy = self._busy()
        if self._sandbox_ops:  # the sandboxes' CPU, at the speed they get
            busy.append((0, self.sandbox_cpu * self._sandbox_ops * self._sandbox_rate(busy, 0), False))
        train, other = self.share.slowdowns(busy)
        return train if training else other

    def _busy(self) -> list[tuple[int, float, bool]]:
        """(devices, host demand in cores, whether it trains) of every resource at work now."""
        busy = [(self._devices[name], 0.0, True) for name in self.training]
        for engine in self._engines:
            if engine.state is EngineState.RUNNING:
                busy.append((self._devices[engine.name], engine.host_demand, False))
            elif engine.state is EngineState.SYNCING:
                busy.append((self._devices[engine.name], 0.0, False))
        return busy

    def _sandbox_rate(self, busy: list[tuple[int, float, bool]], starting: int) -> float:
        """The share of its speed alone a sandbox's work gets with `starting` more sandboxes at work than now
        (`workload.sandbox_cpu_cores`; `sim.host.sandbox_rate`)."""
        cores = self._cfg.cluster.host_cores + self._cfg.total_gpus
        devices = sum(n for n, _, _ in busy)
        tokens = sum(cores_ for _, cores_, _ in busy)
        return sandbox_rate(devices, cores, tokens, self.sandbox_cpu * (self._sandbox_ops + starting))

    def sandbox_stretch(self) -> float:
        """How many times longer a sandbox's work started now takes, on a cluster whose devices are the host's
        own cores (`cluster.host_cores` set; 1 otherwise): 1 + (`workload.sandbox_busy_stretch` - 1) x the share
        of the cores busy (training, generating or syncing), times, with `workload.sandbox_cpu_cores` c, (1 - c)
        + c / r, r the speed the sandboxes at work get from the host's cores (`sim.host.sandbox_rate`): its
        computing share slowed, its waiting share not. Timed at its start, as an engine's stretch is."""
        if not self.sandbox_slowed:
            return 1.0
        stretch = self._cfg.workload.sandbox_busy_stretch
        running = self._busy()
        busy = sum(n for n, _, _ in running)
        cores = self._cfg.cluster.host_cores + self._cfg.total_gpus
        factor = 1.0 + (stretch - 1.0) * min(1.0, busy / cores) if cores else stretch
        if self.sandbox_cpu is not None:  # its CPU shares the host's cores with the sandboxes already at work
            cpu = min(1.0, self.sandbox_cpu)  # the share of its time alone a sandbox computes (the rest waits)
            factor *= (1.0 - cpu) + cpu / max(1e-9, self._sandbox_rate(running, 1))
        return factor

    def sandbox_work(self, seconds: float) -> None:
        """A sandbox at work for `seconds` (its share of the host's cores counted meanwhile), counted from now: a
        test run's from before its grader's start, a queued container start's from before its lane is free."""
        if self.sandbox_cpu is None or seconds <= 0:
            return
        self._sandbox_ops += 1
        self.changed()
        self._wake(seconds, self._sandbox_done)

    def _sandbox_done(self) -> None:
        self._sandbox_ops -= 1
        self.changed()

    def train(self, step: int, work_s: float, slow: float, finish: Callable[[float], None]) -> None:
        """Training step `step` starts now with `work_s` seconds of work at full speed, slowed `slow` times;
        `finish(end_s)` when it is done, however the cores' share changes meanwhile."""
        self._train_work[step] = work = _TrainWork(step, finish, work_s, slow, self._now())
        self._wake(work_s * slow, self._train_tick, work, 0)

    def _train_tick(self, work: _TrainWork, epoch: int) -> None:
        if epoch != work.epoch:  # re-timed since
            return
        del self._train_work[work.step]
        work.finish(self._now())
        self.changed()

    def changed(self) -> None:
        """The cores' share may have changed (an engine started a stretch, went idle, paused, synced): re-time
        the training steps under way, the work done so far at the old share and the rest at the new one. A
        step is long next to the events that change the share (an engine's stretch ends at its next
        completion), so pricing it at its start alone misses what starts right after it: under `async` the
        rollout of the next batch starts just after the trainer takes this one."""
        if not self._train_work:
            return
        slow, now = self.slowdown(training=True), self._now()
        for work in self._train_work.values():
            if slow != work.slow:
                work.left = max(0.0, work.left - (now - work.since) / work.slow)
                work.since, work.slow = now, slow
                work.epoch += 1
                self._wake(work.left * slow, self._train_tick, work, work.epoch)
