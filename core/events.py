"""Events an executor reports to a policy, and decisions a policy returns.

This is the contract between the control plane (a policy) and an executor (the simulator or the
real runtime); `core.driver` runs it. Events describe what happened; decisions say what to do next.
A policy never blocks and never sees time: it is a pure state machine.

Decisions come in two kinds:

- **Awaited** decisions take time and complete with exactly one event: `Preempt` with
  `PreemptFinished`, `SwitchTag` with `SwitchFinished`, `StartTrain` with `TrainFinished` (same
  step), `SyncWeights` with `SyncFinished` (same `sync_id`). They may finish in any order, and the
  driver fails the run if one outlives its deadline.
- **Fire-and-forget** decisions (`Submit`, `Refresh`, `ResumeRollout`) complete with no event of
  their own: an executor may apply them at once or take its time. The groups that `Submit` and
  `Refresh` start finish one by one as `GroupFinished`.

What a policy may rely on, and so what an executor must keep:

- Nothing that must happen after something else is returned beside it: it waits for a completion
  event (a resource is switched to training only after `PreemptFinished`, rollout resumes only after
  `SyncFinished`). Executors still apply a list in the order returned, which keeps the simulator
  deterministic, but no policy's correctness depends on that order.
- A decision never names a resource while an awaited decision on it is outstanding, so an executor
  runs at most one awaited operation per resource at a time (the driver checks this).
- A fire-and-forget decision that names a resource (`ResumeRollout`) takes effect before any later
  decision on that resource starts: an executor that applies it asynchronously keeps per-resource
  order (one command queue per engine does).
- `ResourceLost` abandons every outstanding decision that named the lost resource: no completion
  comes for it, and the executor keeps its inputs (a step's groups, requests in flight go back to the
  queue) so that the policy can issue it again on the survivors. Once an executor has posted the
  loss it is never asked to act on that resource again (the driver abandons awaited decisions made
  before the policy saw the loss, and takes the resource out of fire-and-forget ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from core.tags import Tag

# ---- events (executor -> policy) ----


@dataclass(frozen=True)
class Started:
    """The run begins; every resource is idle with its initial active tag."""


@dataclass(frozen=True)
class GroupFinished:
    """Every sample of a GRPO prompt group finished and was rewarded.

    `min_version` is the oldest policy version that produced any of the group's tokens.
    """

    group_id: int
    min_version: int


@dataclass(frozen=True)
class PreemptFinished:
    """Completes `Preempt(resource)`: the resource generates nothing and holds no request."""

    resource: str


@dataclass(frozen=True)
class SwitchFinished:
    """Completes `SwitchTag(resource, active)`: the resource now runs `active`."""

    resource: str
    active: Tag


@dataclass(frozen=True)
class TrainFinished:
    """Completes `StartTrain(step, ...)`: the new weights are policy version `step + 1`."""

    step: int


@dataclass(frozen=True)
class SyncFinished:
    """Completes the `SyncWeights` with the same `sync_id`: `resources` hold policy `version`."""

    version: int
    resources: tuple[str, ...]
    sync_id: int


@dataclass(frozen=True)
class ResourceIdle:
    """A rollout resource has no request to run (a bubble, unless the policy fills it)."""

    resource: str


@dataclass(frozen=True)
class ResourceLost:
    """A resource died (its devices, its engine or its trainer shard). It never comes back; every
    outstanding decision that named it is abandoned (see the module docstring)."""

    resource: str


Event = (
    Started
    | GroupFinished
    | PreemptFinished
    | SwitchFinished
    | TrainFinished
    | SyncFinished
    | ResourceIdle
    | ResourceLost
)

# ---- decisions (policy -> executor) ----


@dataclass(frozen=True)
class Submit:
    """Fire-and-forget: start `num_groups` new prompt groups (each of group-size samples)."""

    num_groups: int


@dataclass(frozen=True)
class Preempt:
    """Awaited (`PreemptFinished`): stop rollout on a resource; its unfinished requests keep their
    tokens and go back to the queue to resume elsewhere (partial rollout). In real time this pauses
    an engine and migrates its requests, so it takes time."""

    resource: str


@dataclass(frozen=True)
class SwitchTag:
    """Awaited (`SwitchFinished`): change a resource's active tag (offload one role's state, onload
    the other's). A switch to `train` is only issued on a resource that holds no request."""

    resource: str
    active: Tag


@dataclass(frozen=True)
class StartTrain:
    """Awaited (`TrainFinished`): run training step `step` on `resources`, consuming the finished
    groups `group_ids`. Issued again with the same step and groups if a resource was lost."""

    step: int
    group_ids: tuple[int, ...]
    resources: tuple[str, ...]


@dataclass(frozen=True)
class Refresh:
    """Fire-and-forget: finished groups fell out of the staleness bound; regenerate each of their
    samples that holds tokens older than `min_keep_version` (a fresh sample of the same prompt); the
    rest are kept. The groups count as in flight again and finish anew."""

    group_ids: tuple[int, ...]
    min_keep_version: int


@dataclass(frozen=True)
class SyncWeights:
    """Awaited (`SyncFinished` with the same `sync_id`): load policy `version` onto rollout resources.

    A resource still generating is paused first at a token boundary, keeping every in-flight request
    (partial rollout). In-flight requests whose oldest token is older than `min_keep_version` are
    restarted from their prompt (their tokens could never be trained within the staleness bound).
    After the sync, a resource that holds paused requests waits for `ResumeRollout`; one that holds
    none takes new requests at once. `sync_id` is unique within a run.
    """

    version: int
    resources: tuple[str, ...]
    min_keep_version: int
    sync_id: int


@dataclass(frozen=True)
class ResumeRollout:
    """Fire-and-forget: continue generation; each paused request re-prefills its prefix under the
    new weights."""

    resources: tuple[str, ...]


Decision = Submit | Preempt | SwitchTag | StartTrain | Refresh | SyncWeights | ResumeRollout

# ---- which event completes which decision ----

Completion = tuple[str, object]


def awaits(decision: Decision) -> Completion | None:
    """The key of the event that completes `decision`; None for a fire-and-forget decision."""
    match decision:
        case Preempt(resource):
            return ("preempt", resource)
        case SwitchTag(resource, active):
            return ("switch", (resource, active))
        case StartTrain(step):
            return ("train", step)
        case SyncWeights(sync_id=sync_id):
            return ("sync", sync_id)
        case Submit() | Refresh() | ResumeRollout():
            return None
        case _:
            assert_never(decision)


def completes(event: Event) -> Completion | None:
    """The key of the decision `event` completes (matches `awaits`); None for other events."""
    match event:
        case PreemptFinished(resource):
            return ("preempt", resource)
        case SwitchFinished(resource, active):
            return ("switch", (resource, active))
        case TrainFinished(step):
            return ("train", step)
        case SyncFinished(sync_id=sync_id):
            return ("sync", sync_id)
        case Started() | GroupFinished() | ResourceIdle() | ResourceLost():
            return None
        case _:
            assert_never(event)


def resources_of(item: Decision | Event) -> tuple[str, ...]:
    """The resources a decision acts on, or an event reports on (empty if none)."""
    match item:
        case Preempt(resource) | SwitchTag(resource) | PreemptFinished(resource) | SwitchFinished(resource):
            return (resource,)
        case ResourceIdle(resource) | ResourceLost(resource):
            return (resource,)
        case StartTrain(resources=resources) | SyncWeights(resources=resources) | SyncFinished(resources=resources):
            return resources
        case ResumeRollout(resources):
            return resources
        case _:
            return ()
