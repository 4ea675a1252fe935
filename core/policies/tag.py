"""`tag`: SeamlessFlow's spatiotemporal multiplexing, driven by capability and active tags.

Rollout-only resources never stop generating. Train-capable resources carry both tags: while the
trainer waits for data they roll out; as soon as a full batch is ready they are preempted (their
unfinished requests keep their tokens and resume elsewhere) and switched to training. After a step,
rollout-only resources pause, load the new weights and resume every request from its prefix
(partial rollout), while the train resources either train the next ready batch at once or switch
back to rollout. Training has priority over rollout on shared resources: decode is memory-bound and
can run on any resource, training is compute-bound and can only run where its state lives.

Staleness is bounded by `max_staleness` (default 1, the paper's one-step lag): at a weight update,
requests holding tokens older than the bound restart from their prompt, and a finished group that
fell out of the bound has its stale samples regenerated rather than being trained.
"""

from __future__ import annotations

import enum

from core.events import (
    Decision,
    Event,
    GroupFinished,
    Preempt,
    PreemptFinished,
    ResourceIdle,
    ResourceLost,
    ResumeRollout,
    Started,
    SwitchFinished,
    SwitchTag,
    SyncFinished,
    TrainFinished,
)
from core.policies.base import BasePolicy, PolicyConfig, split_pools
from core.tags import Resource, Tag

# What a weight sync is for (see BasePolicy.sync): the train resources' own copy before they roll
# out again, or the rollout-only resources' copy after a step.
TRAINERS, ROLLOUT_ONLY = "trainers", "rollout-only"


class _Mode(enum.Enum):
    ROLLOUT = "rollout"  # train resources roll out
    TO_TRAIN = "to_train"  # they are preempted, then switched to training
    TRAIN = "train"
    TO_ROLLOUT = "to_rollout"  # they switch back, then load the newest weights


class TagPolicy(BasePolicy):
    name = "tag"

    @staticmethod
    def layout(num_resources: int, train_fraction: float, devices: int) -> list[Resource]:
        rollout, train = split_pools(num_resources, train_fraction, devices)
        both = frozenset({Tag.ROLLOUT, Tag.TRAIN})
        return rollout + [Resource(r.name, both, r.devices) for r in train]

    def __init__(self, resources, config: PolicyConfig) -> None:
        super().__init__(resources, config)
        self.window = config.batch_groups * (config.window_batches or 1 + config.max_staleness)
        self._mode = _Mode.ROLLOUT
        self._waiting: set[str] = set()  # train resources whose preemption or switch has not finished

    def on_event(self, event: Event) -> list[Decision]:
        match event:
            case Started():
                return self._top_up()
            case GroupFinished(group_id, min_version):
                self.note_finished(group_id, min_version)
                return self.refresh_stale() + self._top_up() + self._maybe_preempt()
            case PreemptFinished(resource):
                return [SwitchTag(resource, Tag.TRAIN)]
            case SwitchFinished(resource):
                self._waiting.discard(resource)
                return self._switched()
            case TrainFinished(step):
                return self._after_step(step)
            case ResourceIdle(resource):
                return self._fill(resource)
            case SyncFinished():
                return self._synced(event)
            case ResourceLost(resource):
                return self._lose(resource)
        return []

    def _top_up(self) -> list[Decision]:
        """Keep `window` batches in flight or finished, counting the one being trained: a group
        generated now can be trained at most `max_staleness` steps after the current one."""
        training = self.config.batch_groups if self._mode is _Mode.TRAIN else 0
        return self.submit(self.window - training)

    def _fill(self, resource: str) -> list[Decision]:
        """A rollout resource ran dry: start its share of a batch beyond the window, so no
        rollout-capable device idles while there is training left to feed."""
        if self.done or not self.config.fill_idle:
            return []
        rollout_devices = sum(r.devices for r in self.resources.values() if r.can(Tag.ROLLOUT))
        share = self.resources[resource].devices / rollout_devices
        extra = max(1, round(self.config.batch_groups * share))
        return self.submit(self.in_flight + len(self.ready) + extra)

    def _batch_ready(self) -> bool:
        return not self.done and self.admissible_ready() >= self.config.batch_groups

    def _maybe_preempt(self) -> list[Decision]:
        """A full batch is ready: take the train resources back from rollout (each is switched to
        training once its preemption finished)."""
        if self._mode is not _Mode.ROLLOUT or not self._batch_ready():
            return []
        self._mode = _Mode.TO_TRAIN
        self._waiting = set(self.trainers)
        return [Preempt(r) for r in self.trainers]

    def _switched(self) -> list[Decision]:
        """Once every train resource has switched: train, or load the newest weights to roll out."""
        if self._waiting:
            return []
        if self._mode is _Mode.TO_TRAIN:
            return self._train_or_return()
        return [self.sync(self.version, self.trainers, self._floor(), TRAINERS)]

    def _train_or_return(self) -> list[Decision]:
        if not self._batch_ready():  # the batch went stale while switching: go back to rollout
            return self._switch_back()
        self._mode = _Mode.TRAIN
        return self.take_batch(self.trainers) + self._top_up()

    def _after_step(self, step: int) -> list[Decision]:
        self.finish_step(step)
        decisions: list[Decision] = self.refresh_stale()
        # A sync still loading older weights onto the rollout-only resources is followed by this one
        # when it finishes (`_synced`), so a resource never runs two syncs at once.
        if self.rollout_only and not self.done and not self.syncing(ROLLOUT_ONLY):
            decisions.append(self.sync(self.version, self.rollout_only, self._floor(), ROLLOUT_ONLY))
        if self.done:
            return decisions
        if self._batch_ready():
            return decisions + self.take_batch(self.trainers) + self._top_up()
        switch = self._switch_back()  # leave TRAIN mode first, so the top-up counts no training batch
        return decisions + self._top_up() + switch

    def _switch_back(self) -> list[Decision]:
        self._mode = _Mode.TO_ROLLOUT
        self._waiting = set(self.trainers)
        return [SwitchTag(r, Tag.ROLLOUT) for r in self.trainers]

    def _synced(self, event: SyncFinished) -> list[Decision]:
        role = self.synced(event)
        if role == TRAINERS:
            self._mode = _Mode.ROLLOUT
            return self._resume(event.resources) + self._maybe_preempt()
        if event.version < self.version and self.rollout_only and not self.done:  # a step ended meanwhile
            return [self.sync(self.version, self.rollout_only, self._floor(), ROLLOUT_ONLY)]
        return self._resume(event.resources)

    def _lose(self, resource: str) -> list[Decision]:
        decisions = self.lose(resource)
        if resource in self._waiting:  # its preemption or switch will never finish
            self._waiting.discard(resource)
            decisions += self._switched()
        return decisions

    def _floor(self) -> int:
        """The oldest version a request may hold after a weight update."""
        return self.version - self.config.max_staleness

    @staticmethod
    def _resume(resources: tuple[str, ...]) -> list[Decision]:
        return [ResumeRollout(resources)] if resources else []
