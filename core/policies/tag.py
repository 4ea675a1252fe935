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
    PauseRollout,
    Preempt,
    ResourceIdle,
    ResumeRollout,
    Started,
    SwitchFinished,
    SwitchTag,
    SyncFinished,
    SyncWeights,
    TrainFinished,
)
from core.policies.base import BasePolicy, PolicyConfig, split_pools
from core.tags import Resource, Tag


class _Mode(enum.Enum):
    ROLLOUT = "rollout"
    TO_TRAIN = "to_train"
    TRAIN = "train"
    TO_ROLLOUT = "to_rollout"


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
        self._switching: set[str] = set()
        self._rollout_devices = sum(r.devices for r in resources if r.can(Tag.ROLLOUT))

    def on_event(self, event: Event) -> list[Decision]:
        match event:
            case Started():
                return self._top_up()
            case GroupFinished(group_id, min_version):
                self.note_finished(group_id, min_version)
                return self.refresh_stale() + self._top_up() + self._maybe_preempt()
            case SwitchFinished(resource, active):
                self._switching.discard(resource)
                if self._switching:
                    return []
                if active is Tag.TRAIN:
                    return self._train_or_return()
                floor = self.version - self.config.max_staleness
                return [SyncWeights(self.version, self.trainers, floor)]
            case TrainFinished(step):
                return self._after_step(step)
            case ResourceIdle(resource):
                return self._fill(resource)
            case SyncFinished(_, resources):
                decisions: list[Decision] = [ResumeRollout(resources)]
                if resources == self.trainers:
                    self._mode = _Mode.ROLLOUT
                    decisions += self._maybe_preempt()
                return decisions
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
        share = self.resources[resource].devices / self._rollout_devices
        extra = max(1, round(self.config.batch_groups * share))
        return self.submit(self.in_flight + len(self.ready) + extra)

    def _batch_ready(self) -> bool:
        return not self.done and self.admissible_ready() >= self.config.batch_groups

    def _maybe_preempt(self) -> list[Decision]:
        if self._mode is not _Mode.ROLLOUT or not self._batch_ready():
            return []
        self._mode = _Mode.TO_TRAIN
        self._switching = set(self.trainers)
        return [d for r in self.trainers for d in (Preempt(r), SwitchTag(r, Tag.TRAIN))]

    def _train_or_return(self) -> list[Decision]:
        if not self._batch_ready():  # the batch went stale while switching: go back to rollout
            return self._switch_back()
        self._mode = _Mode.TRAIN
        return self.take_batch(self.trainers) + self._top_up()

    def _after_step(self, step: int) -> list[Decision]:
        self.finish_step(step)
        decisions: list[Decision] = self.refresh_stale()
        if self.rollout_only and not self.done:
            floor = self.version - self.config.max_staleness
            decisions += [PauseRollout(self.rollout_only), SyncWeights(self.version, self.rollout_only, floor)]
        if self.done:
            return decisions
        if self._batch_ready():
            return decisions + self.take_batch(self.trainers) + self._top_up()
        switch = self._switch_back()  # leave TRAIN mode first, so the top-up counts no training batch
        return decisions + self._top_up() + switch

    def _switch_back(self) -> list[Decision]:
        self._mode = _Mode.TO_ROLLOUT
        self._switching = set(self.trainers)
        return [SwitchTag(r, Tag.ROLLOUT) for r in self.trainers]
