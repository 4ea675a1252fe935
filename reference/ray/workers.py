"""Resource workers as Ray actors, placed by capability tags.

Each `ResourceWorker` (reference/control/worker.py) runs as one actor that asks Ray for its cores and one
unit of each of its capability tags, which are Ray custom resources: a node offers `{"rollout": n,
"train": m}` and Ray places each worker on a node that can run what it may be asked to run. The embedded
default (`ray_address` None) starts a local Ray sized to this machine: as many CPUs as it has cores and
as many tag units as the plan's workers need. `ray_address` joins an existing cluster instead, whose
nodes must offer the tags (`ray start --resources='{"rollout": 8, "train": 8}'`); scaling past one
machine is Ray's job.

Calls (`reference/control/calls.py`'s `WorkerGroup`, named by the `ResourceWorker` method) return Ray object
refs, which asyncio awaits directly.

Weights without a shared filesystem (`engine.weights_transport: object_store`): `call_split` leaves a trainer's
payload in Ray's object store, owned by this process, and its ref is passed to each engine's worker, which Ray
resolves on that worker's node (moving the bytes there once); the ref is released when every worker has written
its copy. `initial_weights` ships the initial weights' directory to every worker the same way. A worker's own
root is under its Ray node's temporary directory (`ray start --temp-dir`), unless `engine.weights_local_root`
names another.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import ray

from core.errors import UserError
from reference.control.calls import WorkerGroup
from reference.control.worker import ResourceWorker, WorkerSpec
from reference.ray.address import check_no_running_cluster
from reference.trainer.handoff import read_files

log = logging.getLogger(__name__)
SHOWN = ("CPU", "rollout", "train")  # a node's resources that a placement problem names


def demand(spec: WorkerSpec) -> dict[str, float]:
    """What a worker's actor asks Ray for: its CPUs (one per thread) and one unit of each capability tag."""
    return {"CPU": float(spec.threads), **{tag: 1.0 for tag in spec.capabilities}}


def placement_problem(specs: Sequence[WorkerSpec], nodes: Sequence[dict]) -> str | None:
    """Why a cluster's alive nodes (`ray.nodes()`) cannot hold the workers, by their total resources (not what is
    free now), as one line; None when they can as far as these checks see: some node holds each worker alone, and
    the cluster's totals hold them all."""
    offers = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    kinds = Counter(
        ", ".join(f"{k} {o[k]:g}" for k in SHOWN if k in o) or "none of CPU, rollout, train" for o in offers
    )
    shown = "; ".join(f"{n} x ({kind})" for kind, n in sorted(kinds.items()))  # ray.nodes()'s order varies
    for spec in specs:
        need = demand(spec)
        if not any(all(o.get(k, 0.0) >= v for k, v in need.items()) for o in offers):
            wanted = ", ".join(f"{k} {v:g}" for k, v in need.items())
            return (
                f"no node of the Ray cluster offers what worker {spec.name} asks for ({wanted}; CPUs are "
                f"resources.cores_per_resource); its nodes offer: {shown or 'none alive'}"
            )
    total = Counter()
    for spec in specs:
        total.update(demand(spec))
    for key, need in total.items():
        have = sum(o.get(key, 0.0) for o in offers)
        if have < need:
            return f"the run's workers ask the Ray cluster for {key} {need:g} in all; its nodes offer {have:g}: {shown}"
    return None


class _RayResourceWorker(ResourceWorker):
    """A resource worker whose node-local files go under its Ray node's temporary directory."""

    def node_temp_dir(self) -> str:
        return ray.get_runtime_context().get_temp_dir()


class ActorWorkers(WorkerGroup):
    """A `WorkerGroup` over `ResourceWorker` actors, by resource name."""

    def __init__(self, actors: dict) -> None:
        self.actors = actors

    def call(self, resource: str, method: Callable, *args: Any):
        """`method(*args)` on the resource's worker: an awaitable Ray object ref."""
        return getattr(self.actors[resource], method.__name__).remote(*args)

    def call_split(self, resource: str, method: Callable, *args: Any):
        """`method(*args)`, which returns a pair, with each part its own object ref: the first awaited for what it
        says, the second (a payload) left in the object store and passed on to other calls unread."""
        return getattr(self.actors[resource], method.__name__).options(num_returns=2).remote(*args)

    def get(self, resource: str, method: Callable, *args: Any, timeout_s: float = 600.0):
        """The same, waited for (from a thread that is not an event loop)."""
        return ray.get(self.call(resource, method, *args), timeout=timeout_s)


class RayWorkers(ActorWorkers):
    """The workers of a run on Ray. Use as a context manager: actors (and a Ray started here) are released."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        address: str | None = None,
        start_timeout_s: float = 600.0,
        initial_weights: str | None = None,
    ):
        """`initial_weights`: a directory (the specs' `model_dir`) that only this machine may see: its files go
        to every worker through the object store, and each starts from its own copy."""
        self.specs = {s.name: s for s in specs}
        self._started_ray = False
        self._local = address is None
        tags = Counter(tag for s in specs for tag in s.capabilities)
        if not ray.is_initialized():
            # ray.init replaces the SIGTERM handler with sys.exit, which would skip the run's clean stop (a SWE
            # task's sandboxes removed): the handler in place before it is put back.
            main = threading.current_thread() is threading.main_thread()
            sigterm = signal.getsignal(signal.SIGTERM) if main else None
            try:
                if address is None:
                    check_no_running_cluster()  # else ray.init would join it and refuse the sizes below
                    ray.init(
                        num_cpus=len(os.sched_getaffinity(0)),
                        resources=dict(tags),
                        include_dashboard=False,
                        logging_level=logging.ERROR,
                        log_to_driver=False,
                        configure_logging=True,
                    )
                else:
                    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = address or "a local Ray"
                raise UserError(f"cannot reach the Ray cluster at {where!r}: {str(e).splitlines()[0]}") from None
            finally:
                if sigterm is not None:
                    signal.signal(signal.SIGTERM, sigterm)
            self._started_ray = True
        problem = None if self._local else placement_problem(specs, ray.nodes())
        if problem:  # a cluster with an autoscaler may still add such nodes: say so now, give up at the deadline
            log.warning("%s; waiting up to %.0f s for it to start the workers", problem, start_timeout_s)
        actor = ray.remote(_RayResourceWorker)
        super().__init__({})
        try:
            initial = ray.put(read_files(initial_weights)) if initial_weights is not None else None
            self.actors = {
                s.name: actor.options(
                    num_cpus=s.threads,
                    resources={t: 1 for t in s.capabilities},
                    name=f"seamlessflow-{s.name}-{os.getpid()}",
                    max_restarts=0,
                ).remote(s, initial)
                for s in specs
            }
            del initial  # each actor holds its own copy once constructed: the object is released then
            pings = {name: a.ping.remote() for name, a in self.actors.items()}
            ray.get(list(pings.values()), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            # a worker Ray never placed has nothing to close: killed at once (closing it would wait out close's
            # whole timeout for a call that cannot run); the ones that started close as usual
            ready = set(ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)[0])
            for name in [n for n, ref in pings.items() if ref not in ready]:
                ray.kill(self.actors.pop(name), no_restart=True)
            self.close()
            where = "a local Ray" if self._local else f"the Ray cluster at {address!r}"
            why = f": {problem}" if problem else ""
            raise UserError(f"{where} did not start the run's workers within {start_timeout_s:.0f} s{why}") from None
        except BaseException:
            self.close()
            raise

    def init_trainers(
        self,
        trainers: Sequence[str],
        trainer_config: dict,
        checkpoints: str | None = None,
        resume: str | None = None,
        parallel: dict | None = None,
    ) -> list[int]:
        """Every train-capable resource builds its shard and joins the data-parallel group (gloo, in rank
        order), from the initial weights or the checkpoint `resume`; returns the step each starts at.
        `parallel`: `DataParallel`'s settings (FSDP needs the group even for one shard)."""
        grouped = len(trainers) > 1 or bool((parallel or {}).get("fsdp"))
        address = self.get(trainers[0], ResourceWorker.free_address, self._local) if grouped else ""
        init = ResourceWorker.init_trainer
        refs = [
            self.call(r, init, rank, len(trainers), address, trainer_config, checkpoints, resume, parallel)
            for rank, r in enumerate(trainers)
        ]
        return ray.get(refs, timeout=600)

    def kill(self, resource: str) -> None:
        """Kill a worker's actor process (fault injection)."""
        ray.kill(self.actors[resource], no_restart=True)

    def close(self, timeout_s: float = 60.0) -> None:
        """Close every worker (all at once: one busy with a train step does not hold up the others), waiting at
        most `timeout_s` in all, then kill their actors."""
        closing = {}
        for name, a in self.actors.items():
            try:
                closing[name] = a.close.remote()
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to close
                pass
        deadline = time.monotonic() + timeout_s
        for name, a in list(self.actors.items()):
            try:
                if name in closing:
                    ray.get(closing[name], timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to close; a busy one is killed
                pass
            ray.kill(a, no_restart=True)
            del self.actors[name]
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> RayWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
