"""Events an executor reports to a policy, and decisions a policy returns.

This is the contract between the control plane (a policy) and an executor (the simulator or the
real runtime). Events describe what happened; decisions say what to do next. An executor applies
decisions in the order returned and reports each completion as a new event, so a policy never
blocks and never sees time: it is a pure state machine.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class SwitchFinished:
    resource: str
    active: Tag


@dataclass(frozen=True)
class TrainFinished:
    step: int


@dataclass(frozen=True)
class SyncFinished:
    version: int
    resources: tuple[str, ...]


@dataclass(frozen=True)
class ResourceIdle:
    """A rollout resource has no request to run (a bubble, unless the policy fills it)."""

    resource: str


Event = Started | GroupFinished | SwitchFinished | TrainFinished | SyncFinished | ResourceIdle

# ---- decisions (policy -> executor) ----


@dataclass(frozen=True)
class Submit:
    """Start `num_groups` new prompt groups (each of group-size samples)."""

    num_groups: int


@dataclass(frozen=True)
class Preempt:
    """Stop rollout on a resource now; its unfinished requests keep their tokens and go back to the
    queue to resume elsewhere (partial rollout)."""

    resource: str


@dataclass(frozen=True)
class SwitchTag:
    """Change a resource's active tag (offload one role's state, onload the other's)."""

    resource: str
    active: Tag


@dataclass(frozen=True)
class StartTrain:
    """Run training step `step` on `resources`, consuming the finished groups `group_ids`."""

    step: int
    group_ids: tuple[int, ...]
    resources: tuple[str, ...]


@dataclass(frozen=True)
class Refresh:
    """Finished groups fell out of the staleness bound: regenerate each of their samples that holds
    tokens older than `min_keep_version` (a fresh sample of the same prompt); the rest are kept.
    The groups count as in flight again and finish anew."""

    group_ids: tuple[int, ...]
    min_keep_version: int


@dataclass(frozen=True)
class PauseRollout:
    """Stop generation on resources at a token boundary, keeping every in-flight request."""

    resources: tuple[str, ...]


@dataclass(frozen=True)
class SyncWeights:
    """Load policy `version` onto paused or idle rollout-active resources.

    In-flight requests whose oldest token is older than `min_keep_version` are restarted from their
    prompt (their tokens could never be trained within the staleness bound).
    """

    version: int
    resources: tuple[str, ...]
    min_keep_version: int


@dataclass(frozen=True)
class ResumeRollout:
    """Continue generation: each unfinished request re-prefills its prefix under the new weights."""

    resources: tuple[str, ...]


Decision = Submit | Preempt | SwitchTag | StartTrain | Refresh | PauseRollout | SyncWeights | ResumeRollout
