"""Capability and active tags: the control plane's vocabulary.

A resource is a group of devices that runs one inference engine when its active tag is `rollout` or
a shard of the trainer when it is `train`. Its capability tags say what it may run; its active tag
says what it runs now. Colocated resources carry both tags and switch in lock-step; disaggregated
pools carry one each; SeamlessFlow's multiplexing gives train resources both, so they roll out while
the trainer waits for data.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tag(enum.StrEnum):
    ROLLOUT = "rollout"
    TRAIN = "train"

    def __repr__(self) -> str:  # short in the reprs of decisions that errors quote
        return f"Tag.{self.name}"


class Phase(enum.StrEnum):
    """What a resource is doing during a timeline interval."""

    ROLLOUT = "rollout"
    TRAIN = "train"
    SYNC = "sync"
    SWITCH = "switch"
    IDLE = "idle"


class SandboxPhase(enum.StrEnum):
    """What an agent task's sandbox lane holds during a sandbox interval (`core.timeline.SandboxInterval`).

    Lanes are containers, not devices: they never count in a resource's phases or the metrics. `tool` and
    `test_run` are named as the simulator's SWE workload names the waits they measure (`tool_latency_s`,
    `test_run_s`)."""

    START = "start"  # the container starting, the task's checkout copied in
    SPARE = "spare"  # started ahead of need, waiting for an episode
    MODEL = "model"  # held by an episode whose agent waits for the model
    TOOL = "tool"  # an agent's command running
    TEST_RUN = "test_run"  # the grader's test run


@dataclass(frozen=True)
class Resource:
    """A schedulable unit: `devices` accelerators that share one role at a time."""

    name: str
    capabilities: frozenset[Tag]
    devices: int

    def __post_init__(self) -> None:
        if not self.capabilities:
            raise ValueError(f"resource {self.name!r} has no capability tags")
        if self.devices < 1:
            raise ValueError(f"resource {self.name!r} needs at least one device, got {self.devices}")

    def can(self, tag: Tag) -> bool:
        return tag in self.capabilities

    @property
    def tag_names(self) -> tuple[str, ...]:
        return tuple(sorted(t.value for t in self.capabilities))
