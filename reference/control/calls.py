"""Typed calls on the resources' workers: a handle per role, whose methods run the worker's own and return its
records (`reference/control/worker.py`), as verl calls its worker groups as methods.

    await workers.trainer("T00").train_step(shard)                  -> StepMetrics
    await workers.rollout("R00").stage_weights(version, payload, keep)  -> WeightsCopy

A `WorkerGroup` says how a call reaches a resource's worker: a Ray actor (`reference/ray/workers.py`, the only
Ray here) or a worker in this process (`LocalWorkers`, for tests). It is handed the `ResourceWorker` method
itself, never its name as a string: what a handle takes and returns is the worker's own signature, which a type
checker follows. The executor, the weight transports and the evaluations see only the handles.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from reference.control.worker import Evaluation, ResourceWorker, WeightsCopy
from reference.trainer.batch import Trajectory
from reference.trainer.trainer import StepMetrics

T = TypeVar("T")


class WorkerGroup(ABC):
    """The resources' workers, by resource name: `trainer(r)` and `rollout(r)` give typed handles; a subclass
    says how a call reaches a worker."""

    @abstractmethod
    def call(self, resource: str, method: Callable[..., T], *args: Any) -> Awaitable[T]:
        """`method(*args)` (a `ResourceWorker` method) on `resource`'s worker, awaitable."""

    @abstractmethod
    def call_split(self, resource: str, method: Callable[..., tuple[T, Any]], *args: Any) -> tuple[Awaitable[T], Any]:
        """A call whose result is a pair: an awaitable of the first part, and a handle to the second that other
        calls take as an argument and receive as its value, never read here (the object-store weight transport's
        payload)."""

    @abstractmethod
    def get(self, resource: str, method: Callable[..., T], *args: Any, timeout_s: float = 600.0) -> T:
        """`call`, waited for (from a thread that is not an event loop)."""

    def trainer(self, resource: str) -> TrainerHandle:
        """The trainer shard of train-capable `resource`."""
        return TrainerHandle(self, resource)

    def rollout(self, resource: str) -> RolloutHandle:
        """The worker that owns rollout-capable `resource`'s engine."""
        return RolloutHandle(self, resource)


@dataclass(frozen=True)
class TrainerHandle:
    """A trainer shard's calls. Every shard of the data-parallel group makes each call together."""

    group: WorkerGroup
    resource: str

    async def train_step(self, shard: list[Trajectory]) -> StepMetrics:
        """One optimiser step; the figures are global over the ranks."""
        return await self.group.call(self.resource, ResourceWorker.train_step, shard)

    async def evaluate(self, task_name: str, options: dict, seed: int, temperature: float) -> Evaluation:
        """A held-out evaluation of the shard's current weights, drawn in-process at `temperature`."""
        return await self.group.call(self.resource, ResourceWorker.evaluate, task_name, options, seed, temperature)

    async def publish(self, root: str) -> WeightsCopy | None:
        """The current weights as a version directory under `root` (rank 0 says where; the others None)."""
        return await self.group.call(self.resource, ResourceWorker.publish, root)

    def publish_payload(self, dtype: str) -> tuple[Awaitable[WeightsCopy | None], Any]:
        """The current weights cast to `dtype`, left where they are made: what rank 0 says of them (the others
        None), and a handle to the payload that `RolloutHandle.stage_weights` takes."""
        return self.group.call_split(self.resource, ResourceWorker.publish_payload, dtype)


@dataclass(frozen=True)
class RolloutHandle:
    """The calls on the worker that owns an engine."""

    group: WorkerGroup
    resource: str

    async def stage_weights(self, version: int, payload: Any, keep: list[int]) -> WeightsCopy:
        """Write `payload` (a `TrainerHandle.publish_payload` handle) on the worker's node for its engine; the
        versions of `keep` stay written."""
        return await self.group.call(self.resource, ResourceWorker.stage_weights, version, payload, keep)

    async def weights_dtype(self) -> str | None:
        """The dtype its engine holds weights in."""
        return await self.group.call(self.resource, ResourceWorker.engine_weights_dtype)

    async def model_dir(self) -> str:
        """The initial weights' directory as the worker (and its engine) reads it."""
        return await self.group.call(self.resource, ResourceWorker.model_dir)


class LocalWorkers(WorkerGroup):
    """Workers in this process, by resource name (tests): a call runs in a thread; a split call's second part is
    handed on as it is. A worker may be any object with the methods called (a fake of some of them)."""

    def __init__(self, workers: dict[str, Any]) -> None:
        self.workers = workers

    def call(self, resource: str, method: Callable[..., T], *args: Any) -> Awaitable[T]:
        return asyncio.to_thread(self._bound(resource, method), *args)

    def call_split(self, resource: str, method: Callable[..., tuple[T, Any]], *args: Any) -> tuple[Awaitable[T], Any]:
        first, second = self._bound(resource, method)(*args)

        async def said() -> T:
            return first

        return said(), second

    def get(self, resource: str, method: Callable[..., T], *args: Any, timeout_s: float = 600.0) -> T:
        return self._bound(resource, method)(*args)

    def _bound(self, resource: str, method: Callable[..., T]) -> Callable[..., T]:
        return getattr(self.workers[resource], method.__name__)
