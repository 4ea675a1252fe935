"""How each published version of the weights reaches the engines (`engine.weights_transport`).

`directory` (the default): the trainer's rank 0 writes the version as a directory under the run's
`OUT/weights/` (`reference.trainer.handoff.publish_weights`, in the model's dtype) and every engine is told to
load that path. Every worker must see the same filesystem: one machine, or a shared one.

`object_store`: nothing is written where the trainer runs. Rank 0 returns the engine-facing tensors, cast to the
engines' dtype (the backend's: `EngineSpec.weights_dtype`), and Ray keeps them in its object store, once a
version (`TrainerHandle.publish_payload`). As soon as a version is published, the worker of every engine is handed its
object ref; Ray moves the bytes to that worker's node, and the worker writes them under a root of its own there
(`RolloutHandle.stage_weights`), keeping the newest few versions and the one its engine holds. A sync waits for
its engines' copies (before pausing them) and tells each engine to load its own; a restarted engine reloads its
version from the same copy (the manager keeps each engine's source). The executor drops its ref to a version's
payload when every worker has its copy, so Ray frees it: the store holds a version only while it is in transit.

Both answer `publish(trainers, version)` (what rank 0's publish says: a `WeightsCopy`) and `sources(version,
engines)` (what `TrajectoryManager.update_weights` takes: one path for all, or one per engine). Both reach the
workers through `reference/control/calls.py`'s handles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from reference.control.calls import WorkerGroup
from reference.control.worker import WeightsCopy
from reference.trainer.handoff import KEEP_LATEST_VERSIONS, prune_versions, version_dir


class DirectoryTransport:
    """Versions as directories under `root`, which every engine reads (module docstring)."""

    name = "directory"

    def __init__(self, workers: WorkerGroup, root: Path, keep_version: Callable[[int], bool]) -> None:
        """`keep_version`: published versions never pruned (the initial weights, those a checkpoint resumes from)."""
        self.workers, self.root, self.keep_version = workers, Path(root), keep_version
        self.failure: BaseException | None = None
        self.stage_s: list[float] = []  # nothing is staged: every engine reads the one directory

    async def publish(self, trainers: Sequence[str], version: int) -> WeightsCopy:
        handoffs = await asyncio.gather(*(self.workers.trainer(r).publish(str(self.root)) for r in trainers))
        await asyncio.to_thread(prune_versions, self.root, version, self.keep_version)
        return next(h for h in handoffs if h is not None)

    async def sources(self, version: int, engines: Sequence[str]) -> str:
        return str(version_dir(self.root, version))

    async def close(self) -> None:
        pass


class ObjectStoreTransport:
    """Versions through Ray's object store to a node-local copy per engine (module docstring)."""

    name = "object_store"

    def __init__(
        self,
        workers: WorkerGroup,
        engines: Sequence[str],
        dtype: str,
        initial: Mapping[str, str],
        held: Callable[[str], int],
        initial_version: int = 0,
    ) -> None:
        """`engines`: the resources whose workers own an engine; `dtype`: the dtype their engines hold weights in;
        `initial`: each engine's initial weights as its worker sees them (version `initial_version`); `held`: the
        version an engine holds now (its worker keeps that copy whatever else it prunes)."""
        self.workers, self.engines, self.dtype, self.held = workers, tuple(engines), dtype, held
        self.initial, self.initial_version = dict(initial), initial_version
        self.failure: BaseException | None = None  # a copy that could not be made: the run stops with it
        self.stage_s: list[float] = []  # each version's slowest copy (fetch to the node + write there)
        self._staging: dict[int, asyncio.Task] = {}  # version -> its copies: {engine: path}
        self._tasks: set[asyncio.Task] = set()

    async def publish(self, trainers: Sequence[str], version: int) -> WeightsCopy:
        start = time.perf_counter()
        calls = [self.workers.trainer(r).publish_payload(self.dtype) for r in trainers]
        metas = await asyncio.gather(*(meta for meta, _ in calls))
        rank0 = next(i for i, meta in enumerate(metas) if meta is not None)
        payload = calls[rank0][1]
        del calls  # the other ranks' refs (to None)
        if metas[rank0].version == version:  # else the executor stops the run on the mismatch
            self._stage(version, payload)
        # the trainer's time to gather and cast, and Ray's to store its result: the step waits for all of it
        return dataclasses.replace(metas[rank0], seconds=time.perf_counter() - start)

    def _stage(self, version: int, payload) -> None:
        """Every engine's worker copies `version` to its node, in the background; the payload's ref lives in
        that task alone, so Ray frees the object once every copy is made."""
        keep = {e: self.held(e) for e in self.engines}
        task = asyncio.get_running_loop().create_task(self._copies(version, payload, keep))
        self._staging[version] = task
        self._tasks.add(task)
        task.add_done_callback(self._done(version))
        for old in [v for v in self._staging if v <= version - KEEP_LATEST_VERSIONS]:
            del self._staging[old]  # its workers pruned it too

    async def _copies(self, version: int, payload, keep: dict[str, int]) -> dict[str, str]:
        results = await asyncio.gather(
            *(self.workers.rollout(e).stage_weights(version, payload, [keep[e]]) for e in self.engines)
        )
        self.stage_s.append(max((r.seconds for r in results), default=0.0))
        return {e: r.path for e, r in zip(self.engines, results, strict=True)}

    def _done(self, version: int) -> Callable[[asyncio.Task], None]:
        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None and self.failure is None:
                self.failure = RuntimeError(
                    f"copying weights version {version} to the engines' nodes failed: {task.exception()}"
                )
                self.failure.__cause__ = task.exception()

        return done

    async def sources(self, version: int, engines: Sequence[str]) -> dict[str, str]:
        """Each engine's own copy of `version` (waiting for the copies still being made)."""
        task = self._staging.get(version)
        if task is None:
            if version == self.initial_version:
                return {e: self.initial[e] for e in engines}
            kept = sorted(self._staging)
            raise RuntimeError(f"weights version {version} is not on the engines' nodes (kept: {kept})")
        paths = await asyncio.shield(task)
        return {e: paths[e] for e in engines}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._staging.clear()


async def object_store_transport(workers: WorkerGroup, manager, initial_version: int = 0) -> ObjectStoreTransport:
    """The object-store transport to every engine the manager fronts (each named after its resource): the dtype
    from their workers' engine specs (one for all), their initial weights as each worker sees them."""
    engines = [slot.name for slot in manager.router.slots]
    dtypes = await asyncio.gather(*(workers.rollout(e).weights_dtype() for e in engines))
    if len(set(dtypes)) != 1 or None in dtypes:
        found = dict(zip(engines, dtypes, strict=True))
        raise RuntimeError(f"the object-store weight transport needs one engine dtype, got {found}")
    initial = await asyncio.gather(*(workers.rollout(e).model_dir() for e in engines))
    return ObjectStoreTransport(
        workers,
        engines,
        dtypes[0],
        dict(zip(engines, initial, strict=True)),
        lambda e: manager.router.slot(e).version,
        initial_version,
    )
