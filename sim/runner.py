"""The simulator: SimPy executes a policy's decisions against the cost model and workload.

The control loop is `core.driver.Driver`, the same one the real runtime runs: every event goes
through it to `policy.on_event`, every decision it returns comes back to one of this executor's
decision methods (`submit`, `preempt`, `switch_tag`, ...), and completions are posted back as
events. An event raised while decisions are being applied (a preemption's `PreemptFinished`) is
queued and handed to the policy after the whole decision list, and a sync's completion is posted
before the engines it freed pull work but handed over after, so a policy never sees the simulator
half-way through an update. The model
applies `Submit`, `Refresh`, `Preempt` and `ResumeRollout` instantly (a preemption posts its
`PreemptFinished` at once); switches, syncs and training steps take the cost model's time.

A `Simulation` is given its parts: the cost models of its devices (`ClusterCosts`, built after the
calibration that set their constants) and its workload; `Simulation.from_config` builds both from the
config. It owns the engines (sim/engine.py, which see it as an `EngineOwner`), the router in front of them
(sim/routing.py) and the host's load on the devices' cores (sim/host_load.py).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import simpy
from simpy.events import NORMAL
from tqdm import tqdm

from core import events as ev
from core import specs
from core.driver import Deadlines, Driver
from core.errors import UserError
from core.outputs import show_progress
from core.policies import PolicyConfig, make_policy, policy_class
from core.tags import Phase, Tag
from core.timeline import StepRecord, Timeline, TimelineRecorder
from sim.calibration import Calibration, calibrated_cost_model
from sim.config import SimConfig, device_name
from sim.cost import CostModel
from sim.engine import EngineState, SimEngine
from sim.host import HostShare
from sim.host_load import HostLoad
from sim.routing import Router
from sim.workload import Sample, SandboxStarts, Workload


def _fire(call: _Call) -> None:
    call.fn(*call.args)


class _Call(simpy.Event):
    """A SimPy timeout that calls `fn(*args)` when processed: `simpy.Timeout` with its callback built
    in. The engines schedule millions of wake-ups; this saves each a closure, a callback list and
    most attribute writes. Like a Timeout it is triggered (ok, value None) when created; its
    callbacks are a class-level tuple, which SimPy swaps for None on the instance when it processes
    the event (and never mutates)."""

    callbacks = (_fire,)
    _ok, _value = True, None

    def __init__(self, env: simpy.Environment, fn: Callable, args: tuple) -> None:
        # Event.__init__ is skipped, as simpy.Timeout skips it.
        self.env, self.fn, self.args = env, fn, args


@dataclass(frozen=True)
class ClusterCosts:
    """The cost models of a run's devices, each built after the calibration that set its constants."""

    train: CostModel  # cluster.device's: the train-capable resources' engines, training, syncs and switches
    rollout: CostModel  # the rollout-only resources' (cluster.rollout_pool's device; `train` itself without a pool)
    calibration: Calibration | None = None  # what costs.profile set on cluster.device: the run's provenance

    @classmethod
    def of(cls, cfg: SimConfig) -> ClusterCosts:
        """Each device's calibration (sim/calibration.py: none without costs.profile, or for a device the profile
        did not measure), then its cost model on the constants it set."""
        model = specs.model(cfg.model)
        train, calibration = calibrated_cost_model(cfg, model, specs.device(cfg.cluster.device))
        pool = cfg.cluster.rollout_pool
        rollout = train if pool is None else calibrated_cost_model(cfg, model, specs.device(pool.device))[0]
        return cls(train, rollout, calibration)


class Simulation:
    def __init__(
        self, cfg: SimConfig, policy: str, costs: ClusterCosts, workload: Workload, progress: bool = False
    ) -> None:
        """Lay out the cluster and check that the model fits (UserError); nothing runs or prints until `run`.
        `costs` prices the work of the cluster's devices and `workload` makes the prompt groups (`from_config`
        builds both from `cfg`)."""
        policy_class(policy)  # an unknown name first: its error lists the choices
        if cfg.num_resources < 2 and policy != "colocated":
            raise UserError(f"policy {policy!r} needs at least 2 resources; the cluster has {cfg.num_resources}")
        self.cfg = cfg
        self.progress = show_progress(progress)
        self.costs = costs
        self.cost, self.rollout_cost = costs.train, costs.rollout  # the train-capable resources', the pool's
        pcfg = PolicyConfig.of(cfg.policy, batch_groups=cfg.workload.prompts_per_step, num_steps=cfg.num_steps)
        self.policy = make_policy(policy, pcfg, cfg.num_resources, cfg.train_fraction, cfg.rollout.tensor_parallel)
        self.resources = self.policy.resources
        self._check_pools()
        # Each resource runs on its pool's device: rollout-only ones on the rollout pool's (one device
        # type unless cluster.rollout_pool is set), train-capable ones on cluster.device.
        self.cost_of = {n: self.rollout_cost if n in self.policy.rollout_only else self.cost for n in self.resources}
        self.train_gpus = sum(self.resources[r].devices for r in self.policy.trainers)
        self.workload = workload
        self._check_fits()
        self.env = simpy.Environment()
        active = {name: self.policy.initial_active(name).value for name in self.resources}
        self.recorder = TimelineRecorder(list(self.resources.values()), active)
        self.engines = self._make_engines(active)
        self.router = Router(self.engines, cfg.rollout.affinity_slack)
        self.events_scheduled = 0  # simulated events (for the speed benchmark)
        self.groups: dict[int, list[Sample]] = {}
        self._left: dict[int, int] = {}
        # rollout.max_concurrency: groups run in at most this many slots, the rest wait in order (as the runtime's
        # rollout manager holds a slot per group); None: every group at once
        cap = cfg.rollout.max_concurrency
        self._slots = None if cap is None else max(1, cap // cfg.workload.group_size)
        self._running: set[int] = set()  # groups holding a slot
        self._waiting: deque[tuple[int, list[Sample]]] = deque()  # groups waiting for one, with their samples
        # workload.sandbox_start_s: containers start in `sandbox_start_slots` lanes, in order (`SandboxStarts`)
        self._sandboxes = SandboxStarts(cfg.workload, cfg.seed) if cfg.workload.sandbox_start_s is not None else None
        self.counters: Counter[str] = Counter()
        # Simulated durations come from the cost model and cannot hang: a stalled run is reported when
        # SimPy runs out of events (see `run`), so no decision needs a deadline.
        self.driver = Driver(self.policy, self, self.recorder, Deadlines.none())
        self._done = self.env.event()
        self._bar: tqdm | None = None
        # cluster.host_cores set: the host's work shares the devices' cores (sim/host.py); else it costs nothing.
        devices = {name: r.devices for name, r in self.resources.items()}
        self.host_load = HostLoad(cfg, devices, list(self.engines.values()), self.wake, self.now)
        self.host: HostShare | None = self.host_load.share

    @classmethod
    def from_config(cls, cfg: SimConfig, policy: str, progress: bool = False) -> Simulation:
        """The simulation of `cfg` under `policy` on the parts `cfg` describes: the calibrated cost models of
        its devices (`ClusterCosts.of`) and its seeded workload."""
        return cls(cfg, policy, ClusterCosts.of(cfg), Workload(cfg.workload, cfg.seed), progress)

    def _make_engines(self, active: dict[str, str]) -> dict[str, SimEngine]:
        """An engine on each rollout-capable resource, by name in resource order, on its device's cost model."""
        cfg, pool, engines = self.cfg, self.cfg.cluster.rollout_pool, {}
        for i, r in enumerate(r for r in self.resources.values() if r.can(Tag.ROLLOUT)):
            cost = self.cost_of[r.name]
            kv = cost.kv_capacity_tokens(self.train_gpus if r.can(Tag.TRAIN) else 0)
            state = EngineState.IDLE if active[r.name] == Tag.ROLLOUT.value else EngineState.OFF
            own_seqs = pool is not None and pool.max_num_seqs and r.name in self.policy.rollout_only
            seqs = pool.max_num_seqs if own_seqs else cfg.rollout.max_num_seqs
            hit = cfg.workload.prefix_cache_hit
            engines[r.name] = SimEngine(self, r.name, i, kv, seqs, state, cost, cfg.rollout, hit)
        return engines

    def _check_pools(self) -> None:
        """With a rollout pool, the policy's rollout-only resources must be exactly its GPUs."""
        pool, tp = self.cfg.cluster.rollout_pool, self.cfg.rollout.tensor_parallel
        if pool is None:
            return
        if not self.policy.rollout_only:
            raise UserError(
                f"policy {self.policy.name!r} trains on every resource, but the {pool.num_gpus} GPUs of "
                "cluster.rollout_pool only generate: drop cluster.rollout_pool or choose a policy with a rollout "
                "pool (disaggregated, async, tag, streaming)"
            )
        assert len(self.policy.rollout_only) == pool.num_gpus // tp, (self.policy.rollout_only, pool)
        assert len(self.policy.trainers) == self.cfg.cluster.num_gpus // tp, (self.policy.trainers, self.cfg.cluster)

    def _check_fits(self) -> None:
        """Every engine's device holds its weights and the longest request, the trainer fits: UserError
        naming the device and the constraint that fails. An engine beside the trainer's weight shard
        is checked first (it has the least room)."""
        longest = self.workload.max_request_tokens
        engines = {}  # (cost model, train GPUs whose weight shard stays resident) -> None, in order
        for r in self.resources.values():
            if r.can(Tag.ROLLOUT):
                engines[(self.cost_of[r.name], self.train_gpus if r.can(Tag.TRAIN) else 0)] = None
        for cost, resident in sorted(engines, key=lambda key: -key[1]):
            cost.check_engine_fits(longest, resident)
        self.cost.check_train_fits(self.train_gpus, longest)

    # ---- the loop ----

    def run(self) -> Timeline:
        # The bar starts here, not in __init__: a CLI builds every simulation (checking its config) first.
        self._bar = tqdm(
            total=self.cfg.num_steps,
            desc=f"sim {self.policy.name}",
            unit="step",
            delay=2.0,
            disable=not self.progress,
            leave=False,
        )
        self._emit(ev.Started())
        try:
            self.env.run(until=self._done)
        except RuntimeError as exc:
            if "No scheduled events left" not in str(exc):
                raise
            outstanding = ", ".join(repr(d) for d in self.driver.outstanding) or "none"
            raise RuntimeError(
                f"simulation stalled at t={self.env.now:.1f}s after {self.policy.step} steps: the policy "
                f"{self.policy.name!r} waits for an event that cannot come (in flight {self.policy.in_flight}, "
                f"queued requests {len(self.router.queue)}, outstanding decisions: {outstanding})"
            ) from None
        finally:
            self._bar.close()
        self._count_dropped()
        return self.recorder.finish(self.env.now, self._meta(), dict(sorted(self.counters.items())))

    def _meta(self) -> dict:
        """The timeline's description of the run. A heterogeneous cluster's device reads "h800+h20"
        (train-capable first) and `pools` gives each pool's device and GPUs; a priced cluster's
        `price_per_hour` lets `summarize` report a cost per token; a calibrated run's `calibration`
        holds the constants its profile set (sim/calibration.py). Devices are named by their `name`, a device
        file's too (not its path)."""
        cluster, pool = self.cfg.cluster, self.cfg.cluster.rollout_pool
        train_device = device_name(cluster.device)
        pool_device = device_name(pool.device) if pool is not None else None
        meta = {
            "policy": self.policy.name,
            "model": self.cfg.model,
            "device": train_device if pool is None else f"{train_device}+{pool_device}",
            "num_gpus": self.cfg.total_gpus,
            "workload": self.cfg.workload.kind,
            "seed": self.cfg.seed,
            "clock": "simulated",
        }
        if pool is not None:
            meta["pools"] = {
                "train": {"device": train_device, "num_gpus": cluster.num_gpus},
                "rollout": {"device": pool_device, "num_gpus": pool.num_gpus},
            }
        if self.cfg.price_per_hour is not None:
            meta["price_per_hour"] = self.cfg.price_per_hour
        if self.costs.calibration is not None:  # costs.profile: what it set, what it kept and why, fit errors
            meta["calibration"] = self.costs.calibration.to_dict()
        return meta

    def _count_dropped(self) -> None:
        """Groups the policy discarded as stale (`streaming` with `stale_samples: drop`; the contract
        has no decision for it, so the groups are still here) were generated and never trained."""
        for gid in getattr(self.policy, "dropped", ()):
            group = self.groups.pop(gid)
            self.counters["dropped_groups"] += 1
            self.counters["wasted_tokens"] += sum(sum(s.version_tokens.values()) for s in group)

    def _emit(self, event: ev.Event) -> None:
        """Report an event; the policy sees it now, or after the decisions being applied."""
        self.driver.post(event)
        self.driver.drain()

    def wake(self, delay: float, fn: Callable, *args) -> None:
        """Call fn(*args) after `delay` simulated seconds."""
        self.events_scheduled += 1
        self.env.schedule(_Call(self.env, fn, args), NORMAL, delay if delay > 0.0 else 0.0)  # max(0.0, delay)

    def now(self) -> float:
        """Simulated seconds since the run started (the executor's clock for the driver)."""
        return self.env.now

    # ---- engine callbacks ----

    def engine_idle(self, engine: SimEngine, now: float) -> None:
        self.recorder.set(engine.name, Phase.IDLE, now, engine.version)
        self.router.engine_idle(engine)
        self.host_share_changed()
        if not self.router.queue:
            self._emit(ev.ResourceIdle(engine.name))

    def engine_busy(self, engine: SimEngine, now: float) -> None:
        self.recorder.set(engine.name, Phase.ROLLOUT, now, engine.version)
        self.router.engine_busy(engine)

    def add_tokens(self, resource: str, tokens: int) -> None:
        self.recorder.add_tokens(resource, tokens)

    def take_for(self, engine: SimEngine, limit: int | None = None) -> list[Sample]:
        return self.router.take_for(engine, limit)

    def host_slowdown(self, training: bool = False) -> float:
        """How many times longer a device's work started now takes (`HostLoad.slowdown`)."""
        return self.host_load.slowdown(training)

    def host_share_changed(self) -> None:
        self.host_load.changed()

    def turn_done(self, engine: SimEngine, sample: Sample) -> None:
        load = self.host_load
        stretch = load.sandbox_stretch() if load.sandbox_slowed else 1.0
        work = wait = sample.current.wait_s * stretch  # the tool call or the test run itself
        first = sample.turn == 0
        over = sample.finish_turn()
        if self._sandboxes is not None:
            if over:  # the grader's container starts before its test run
                ready = self._sandboxes.start(self.env.now, stretch)
                load.sandbox_work(self._sandboxes.last_s)
                wait += ready - self.env.now
            elif first:  # the first tool call waits for the workspace the episode started with
                wait += max(0.0, sample.sandbox_ready - self.env.now)
        if load.sandbox_cpu is not None:
            load.sandbox_work(work)
        then = self._sample_done if over else self._enqueue
        if wait > 0:
            sample.where = "wait"
            self.wake(wait, self._after_wait, then, sample, sample.restarts)
        else:
            then(sample)

    def _after_wait(self, then: Callable, sample: Sample, restarts: int) -> None:
        if sample.restarts == restarts:  # else the sample was restarted while it waited
            then(sample)

    def _sample_done(self, sample: Sample) -> None:
        sample.where = "done"
        gid = sample.group_id
        self._left[gid] -= 1
        if self._left[gid] == 0:
            self._release(gid)
            self._emit(ev.GroupFinished(gid, min(s.min_version for s in self.groups[gid])))

    def _run(self, gid: int, samples: list[Sample]) -> None:
        """Start a group's samples, or keep them waiting for a slot (`rollout.max_concurrency`)."""
        if self._slots is not None:
            if len(self._running) >= self._slots:
                for sample in samples:
                    sample.where = "pending"
                self._waiting.append((gid, samples))
                return
            self._running.add(gid)
        for sample in samples:
            if self._sandboxes is not None:  # its workspace starts with it (the first model call runs meanwhile)
                sample.sandbox_ready = self._sandboxes.start(self.env.now, self.host_load.sandbox_stretch())
                self.host_load.sandbox_work(self._sandboxes.last_s)
            self._enqueue(sample)

    def _enqueue(self, sample: Sample) -> None:
        self.router.route(sample, self.env.now)

    def _release(self, gid: int) -> None:
        """A group finished: its slot goes to the first group waiting."""
        if self._slots is None:
            return
        self._running.discard(gid)
        while self._waiting and len(self._running) < self._slots:
            self._run(*self._waiting.popleft())

    # ---- decisions ----

    def submit(self, d: ev.Submit) -> None:
        for _ in range(d.num_groups):
            group = self.workload.new_group()
            self.groups[group[0].group_id] = group
            self._left[group[0].group_id] = len(group)
            self._run(group[0].group_id, group)

    def preempt(self, d: ev.Preempt) -> None:
        engine = self.engines[d.resource]
        samples = engine.preempt(self.env.now)
        self.recorder.set(d.resource, Phase.IDLE, self.env.now, engine.version)
        self.router.requeue(samples)
        self.counters["preempted_requests"] += len(samples)
        self.host_share_changed()
        self.router.kick(self.engines, self.env.now)  # `kick` keeps the accepting ones
        self.driver.post(ev.PreemptFinished(d.resource))

    def switch_tag(self, d: ev.SwitchTag) -> None:
        """The driver records the switch interval; it ends when `SwitchFinished` is posted."""
        engine = self.engines.get(d.resource)
        if engine is not None and d.active is Tag.TRAIN:
            if engine.active or engine.held:
                raise RuntimeError(f"{d.resource}: switched to train with requests in flight; preempt first")
            engine.state = EngineState.OFF
        duration = self.cost.switch_s(d.active, self.train_gpus)
        self.wake(duration, self._emit, ev.SwitchFinished(d.resource, d.active))

    def start_train(self, d: ev.StartTrain) -> None:
        samples = [s for gid in d.group_ids for s in self.groups.pop(gid)]
        seq_lens = [s.total_tokens for s in samples]
        gpus = sum(self.resources[r].devices for r in d.resources)
        self.host_load.training.update(d.resources)
        work = self.cost.train_step_s(seq_lens, gpus)
        slow = self.host_slowdown(training=True)
        duration = work * slow
        lag = Counter()
        for s in samples:
            for version, n in s.version_tokens.items():
                lag[d.step - version] += n
        tokens = sum(seq_lens)
        record = StepRecord(
            d.step,
            self.env.now,
            self.env.now + duration,
            tokens,
            sum(s.generated_tokens for s in samples),
            dict(sorted(lag.items())),
            len(samples),
        )
        for r in d.resources:
            self.recorder.set(r, Phase.TRAIN, self.env.now, d.step)
            self.recorder.add_tokens(r, tokens * self.resources[r].devices // gpus)
        if self.host is None:
            self.wake(duration, self._train_done, d, record)
        else:  # its end moves with the cores' share (`HostLoad.changed`)
            self.host_load.train(d.step, work, slow, lambda end_s: self._train_done(d, replace(record, end_s=end_s)))

    def _train_done(self, d: ev.StartTrain, record: StepRecord) -> None:
        self.host_load.training.difference_update(d.resources)
        for r in d.resources:
            self.recorder.set(r, Phase.IDLE, self.env.now, d.step + 1)
        self.recorder.add_step(record)
        self._bar.update(1)
        self._emit(ev.TrainFinished(d.step))
        if self.policy.done and not self._done.triggered:
            self._done.succeed()

    def refresh(self, d: ev.Refresh) -> None:
        self._restart_stale(d.min_keep_version, d.group_ids)

    def sync_weights(self, d: ev.SyncWeights) -> None:
        """Pause each engine (keeping its requests) and start loading; the driver records the sync
        interval, which ends when `SyncFinished` is posted. Pausing an engine that generates costs
        `costs.sync_busy_s` more (its step ends first, and the host's loop streams every request's tokens)."""
        generating = any(self.engines[name].state is EngineState.RUNNING for name in d.resources)
        for name in d.resources:
            engine = self.engines[name]
            engine.pause(self.env.now)
            self.recorder.set(name, Phase.IDLE, self.env.now, engine.version)
            engine.start_sync()
        self._restart_stale(d.min_keep_version)
        self.host_share_changed()
        local = all(self.resources[name].can(Tag.TRAIN) for name in d.resources)
        # From the trainer's device to the receivers', at the slowest receiving NIC.
        receiver = min((self.cost_of[name].device for name in d.resources), key=lambda dev: dev.network_gb_s)
        seconds = self.cost.sync_s(local, len(d.resources), receiver)
        seconds += self.cfg.costs.sync_busy_s if generating else 0.0
        self.wake(seconds * self.host_slowdown(), self._sync_done, d)

    def _restart_stale(self, floor: int, refreshed: tuple[int, ...] = ()) -> None:
        """Restart samples holding tokens older than `floor` in unfinished groups (and in finished
        groups the policy sent back into flight), unless they are generating right now (they are
        checked at the next sync)."""
        for gid in refreshed:
            self._left[gid] = 0  # finished; each restarted sample below counts back in
        todo = set(refreshed)
        stale = [
            s
            for gid, group in self.groups.items()
            if self._left[gid] > 0 or gid in todo
            for s in group
            if s.version_tokens and s.min_version < floor and s.where != "engine"
        ]
        if not stale:
            return
        gone = set(stale)
        if any(s.where == "queue" for s in stale):
            self.router.forget(gone)
        for engine in self.engines.values():
            if engine.held and any(s.where == "held" for s in stale):
                engine.held = [s for s in engine.held if s not in gone]
        back: dict[int, list[Sample]] = {}  # finished groups sent back into flight: a slot each, as a new group
        for sample in stale:
            if sample.where == "done":
                self._left[sample.group_id] += 1
                if self._slots is not None:
                    back.setdefault(sample.group_id, []).append(sample)
            self.counters["wasted_tokens"] += sample.restart(self.workload.redraw(sample))
            self.counters["restarted_requests"] += 1
            sample.where = "queue"
            if sample.group_id not in back:
                self.router.queue.append(sample)
        for gid, samples in back.items():
            self._run(gid, samples)

    def _sync_done(self, d: ev.SyncWeights) -> None:
        for name in d.resources:
            self.engines[name].finish_sync(d.version, self.env.now)
        self.host_share_changed()
        self.driver.post(ev.SyncFinished(d.version, d.resources, d.sync_id))  # ends the sync intervals now
        self.router.kick((n for n in d.resources if not self.engines[n].held), self.env.now)
        self.driver.drain()

    def resume_rollout(self, d: ev.ResumeRollout) -> None:
        share = self.router.fair_share(len(d.resources))
        for name in d.resources:
            self.engines[name].resume(self.env.now, share)


def simulate(cfg: SimConfig, policy: str, progress: bool = False) -> Timeline:
    """Run one policy on one config; returns the timeline (score it with core.metrics.summarize).
    `progress`: a progress bar on stderr, if stderr is a terminal."""
    return Simulation.from_config(cfg, policy, progress).run()
