"""`colocated`: every resource rolls out the whole batch, then all switch to training, then sync.

Models verl's hybrid engine: strictly on-policy, one role at a time on every device, so the long
tail of the slowest response and both role switches are bubbles for the whole cluster.
"""

from __future__ import annotations

from core.events import (
    Decision,
    Event,
    GroupFinished,
    ResourceLost,
    Started,
    SwitchFinished,
    SwitchTag,
    SyncFinished,
    TrainFinished,
)
from core.policies.base import BasePolicy
from core.tags import Resource, Tag


class ColocatedPolicy(BasePolicy):
    name = "colocated"
    strictly_on_policy = True

    @staticmethod
    def layout(num_resources: int, train_fraction: float, devices: int) -> list[Resource]:
        del train_fraction  # every resource does both roles
        both = frozenset({Tag.ROLLOUT, Tag.TRAIN})
        return [Resource(f"C{i:02d}", both, devices) for i in range(num_resources)]

    def __init__(self, resources, config) -> None:
        super().__init__(resources, config)
        self._switching: set[str] = set()  # resources whose switch to `_target` is not finished
        self._target = Tag.ROLLOUT

    def on_event(self, event: Event) -> list[Decision]:
        match event:
            case Started():
                return self.submit(self.config.batch_groups)
            case GroupFinished(group_id, min_version):
                self.note_finished(group_id, min_version)
                if self.in_flight == 0:
                    return self._switch_all(Tag.TRAIN)
            case SwitchFinished(resource):
                self._switching.discard(resource)
                return self._switched()
            case TrainFinished(step):
                self.finish_step(step)
                if not self.done:
                    return self._switch_all(Tag.ROLLOUT)
            case SyncFinished():
                self.synced(event)
                return self.submit(self.config.batch_groups)
            case ResourceLost(resource):
                decisions = self.lose(resource)
                if resource in self._switching:
                    self._switching.discard(resource)
                    decisions += self._switched()
                return decisions
        return []

    def _switch_all(self, tag: Tag) -> list[Decision]:
        self._switching, self._target = set(self.trainers), tag
        return [SwitchTag(r, tag) for r in self.trainers]

    def _switched(self) -> list[Decision]:
        """Once every resource has switched: train, or load the new weights for the next rollout."""
        if self._switching:
            return []
        if self._target is Tag.TRAIN:
            return self.take_batch(self.trainers)
        return [self.sync(self.version, self.trainers, self.version)]
