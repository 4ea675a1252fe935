"""What every scheduling policy shares: GRPO batch accounting, the staleness rule, lost resources.

A policy is a state machine. `on_event` takes one event and returns the decisions to apply, in
order. It tracks which prompt groups are in flight or finished, which step trains next, which
policy version each resource holds, and what each resource is doing; it never sees time. The
contract it keeps with executors is in `core/events.py`; `core.driver` runs it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import count
from typing import ClassVar, Protocol

from core.errors import ContractError, RunFailed, UserError
from core.events import Decision, Event, Refresh, StartTrain, Submit, SyncFinished, SyncWeights
from core.policies.settings import PolicyConfig
from core.tags import Resource, Tag


class Policy(Protocol):
    """The seam both executors drive (through `core.driver.Driver`), and what they read of it.

    resources: every resource still in the pools, by name (a lost one is dropped).
    rollout_only, trainers: names of the rollout-only and of the train-capable resources.
    step: the next training step to run; version: the newest policy version (steps completed).
    in_flight: prompt groups submitted and not finished yet.
    """

    name: str
    resources: dict[str, Resource]
    rollout_only: tuple[str, ...]
    trainers: tuple[str, ...]
    step: int
    version: int
    in_flight: int

    def on_event(self, event: Event) -> list[Decision]: ...

    @property
    def done(self) -> bool: ...

    def initial_active(self, resource: str) -> Tag: ...


def split_pools(num_resources: int, train_fraction: float, devices: int) -> tuple[list[Resource], list[Resource]]:
    """Disjoint pools: (rollout resources, train resources), train pool rounded to whole resources."""
    if num_resources < 2:
        raise UserError(f"separate pools need at least 2 resources, got {num_resources}")
    if not 0.0 < train_fraction < 1.0:
        raise UserError(f"pools.train_fraction must be in (0, 1), got {train_fraction}")
    n_train = min(num_resources - 1, max(1, round(num_resources * train_fraction)))
    rollout = [Resource(f"R{i:02d}", frozenset({Tag.ROLLOUT}), devices) for i in range(num_resources - n_train)]
    train = [Resource(f"T{i:02d}", frozenset({Tag.TRAIN}), devices) for i in range(n_train)]
    return rollout, train


class BasePolicy:
    """Batch bookkeeping shared by all the policies, weight syncs by id, and lost resources."""

    name: ClassVar[str]
    strictly_on_policy: ClassVar[bool] = False

    def __init__(self, resources: Sequence[Resource], config: PolicyConfig) -> None:
        self.config = config
        self.resources = {r.name: r for r in resources}
        self.rollout_only = tuple(r.name for r in resources if r.capabilities == {Tag.ROLLOUT})
        self.trainers = tuple(r.name for r in resources if r.can(Tag.TRAIN))
        if not self.trainers:
            raise UserError(f"policy {self.name!r} needs at least one train-capable resource")
        self.version = 0  # completed training steps == newest policy version
        self.step = 0  # next training step to run
        self.in_flight = 0  # submitted groups not yet finished
        self.submitted = 0
        self.consumed = 0
        self.ready: deque[tuple[int, int]] = deque()  # (group_id, min_version), oldest first
        self.running: StartTrain | None = None  # the step being trained
        self.lost: list[str] = []
        self._syncs: dict[int, tuple[SyncWeights, str]] = {}  # sync_id -> (sync in flight, its role)
        self._sync_ids = count()

    def on_event(self, event: Event) -> list[Decision]:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return self.step >= self.config.num_steps

    @property
    def staleness_bound(self) -> int:
        return 0 if self.strictly_on_policy else self.config.max_staleness

    def initial_active(self, resource: str) -> Tag:
        return Tag.ROLLOUT if self.resources[resource].can(Tag.ROLLOUT) else Tag.TRAIN

    # -- group accounting --

    def note_finished(self, group_id: int, min_version: int) -> None:
        if self.in_flight <= 0:
            raise RuntimeError(f"group {group_id} finished but no group was in flight")
        self.in_flight -= 1
        self.ready.append((group_id, min_version))

    def submit(self, outstanding: int) -> list[Decision]:
        """Submit groups until `outstanding` are in flight or finished-but-untrained.

        A run measures `num_steps` steps of a longer training run, so pipelined policies keep
        generating past the last measured step instead of draining (no end-of-run artefact), unless
        `drain` caps what is outstanding at what the remaining steps consume."""
        if self.config.drain:
            outstanding = min(outstanding, self.config.num_steps * self.config.batch_groups - self.consumed)
        n = outstanding - self.in_flight - len(self.ready)
        if n <= 0:
            return []
        self.in_flight += n
        self.submitted += n
        return [Submit(n)]

    def admissible_ready(self) -> int:
        floor = self.step - self.staleness_bound
        return sum(1 for _, v in self.ready if v >= floor)

    def refresh_stale(self) -> list[Decision]:
        """Finished groups that can no longer be trained within the staleness bound (its floor only
        rises) go back into flight: their stale samples are regenerated."""
        floor = self.step - self.staleness_bound
        stale = tuple(g for g, v in self.ready if v < floor)
        if not stale:
            return []
        self.ready = deque((g, v) for g, v in self.ready if v >= floor)
        self.in_flight += len(stale)
        return [Refresh(stale, floor)]

    def take_batch(self, resources: tuple[str, ...]) -> list[Decision]:
        """Refresh groups too stale for this step, then start it on the oldest admissible groups."""
        decisions = self.refresh_stale()
        batch_size = self.config.batch_groups
        if len(self.ready) < batch_size:
            raise RuntimeError(f"step {self.step}: {len(self.ready)} admissible groups < batch {batch_size}")
        # Oldest version first: those groups are the next to fall out of the staleness bound.
        order = sorted(range(len(self.ready)), key=lambda i: (self.ready[i][1], i))
        chosen = set(order[:batch_size])
        batch = tuple(self.ready[i][0] for i in sorted(chosen))
        self.ready = deque(item for i, item in enumerate(self.ready) if i not in chosen)
        self.consumed += batch_size
        self.running = StartTrain(self.step, batch, resources)
        decisions.append(self.running)
        return decisions

    def finish_step(self, step: int) -> None:
        if step != self.step:
            raise RuntimeError(f"train step {step} finished but step {self.step} was running")
        self.step += 1
        self.version = self.step
        self.running = None

    # -- weight syncs, told apart by id --

    def sync(self, version: int, resources: tuple[str, ...], min_keep_version: int, role: str = "") -> SyncWeights:
        """A new `SyncWeights`, remembered with `role` (the policy's name for what it is for)."""
        decision = SyncWeights(version, resources, min_keep_version, next(self._sync_ids))
        self._syncs[decision.sync_id] = (decision, role)
        return decision

    def synced(self, event: SyncFinished) -> str:
        """Forget the sync `event` completes; returns its role."""
        try:
            return self._syncs.pop(event.sync_id)[1]
        except KeyError:
            raise ContractError(f"{event!r} completes no sync in flight (ids {sorted(self._syncs)})") from None

    def syncing(self, role: str | None = None) -> bool:
        """Whether a sync (of `role`, or of any role) is in flight."""
        return any(role is None or r == role for _, r in self._syncs.values())

    # -- lost resources --

    def lose(self, resource: str) -> list[Decision]:
        """Drop a lost resource from the pools and issue again, on the survivors, the training step
        and the weight syncs it took part in (the executor abandoned them). Raises `RunFailed` when no
        train-capable or no rollout-capable resource is left."""
        if resource not in self.resources:
            raise ContractError(f"lost resource {resource!r} is not in the pools ({', '.join(self.resources)})")
        self._drop(resource)
        decisions: list[Decision] = []
        if self.running is not None and resource in self.running.resources:
            decisions.append(self._retrain(resource))
        for sync_id, (sync, _) in list(self._syncs.items()):
            if resource in sync.resources:
                decisions += self._resync(sync_id, resource)
        return decisions

    def _drop(self, resource: str) -> None:
        del self.resources[resource]
        self.lost.append(resource)
        self.rollout_only = tuple(r for r in self.rollout_only if r != resource)
        self.trainers = tuple(r for r in self.trainers if r != resource)
        for tag, kind in ((Tag.TRAIN, "train"), (Tag.ROLLOUT, "rollout")):
            if not any(r.can(tag) for r in self.resources.values()):
                raise RunFailed(
                    f"policy {self.name!r} has no {kind}-capable resource left (lost: {', '.join(self.lost)})"
                )

    def _retrain(self, resource: str) -> StartTrain:
        assert self.running is not None
        survivors = tuple(r for r in self.running.resources if r != resource)
        if not survivors:
            raise RunFailed(
                f"step {self.running.step} lost every resource it trained on (lost: {', '.join(self.lost)})"
            )
        self.running = StartTrain(self.running.step, self.running.group_ids, survivors)
        return self.running

    def _resync(self, sync_id: int, resource: str) -> list[Decision]:
        sync, role = self._syncs[sync_id]
        survivors = tuple(r for r in sync.resources if r != resource)
        if not survivors:  # nothing left to load the weights onto: the sync is over
            return self.on_event(SyncFinished(sync.version, (), sync_id))
        del self._syncs[sync_id]
        return [self.sync(sync.version, survivors, sync.min_keep_version, role)]
