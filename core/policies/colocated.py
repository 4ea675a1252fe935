"""`colocated`: every resource rolls out the whole batch, then all switch to training, then sync.

Models verl's hybrid engine: strictly on-policy, one role at a time on every device, so the long
tail of the slowest response and both role switches are bubbles for the whole cluster.
"""

from __future__ import annotations

from core.events import (
    Decision,
    Event,
    GroupFinished,
    Started,
    SwitchFinished,
    SwitchTag,
    SyncFinished,
    SyncWeights,
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
        self._switching: set[str] = set()

    def on_event(self, event: Event) -> list[Decision]:
        everyone = self.trainers
        match event:
            case Started():
                return self.submit(self.config.batch_groups)
            case GroupFinished(group_id, min_version):
                self.note_finished(group_id, min_version)
                if self.in_flight == 0:
                    return self._switch_all(Tag.TRAIN)
            case SwitchFinished(resource, active):
                self._switching.discard(resource)
                if not self._switching:
                    if active is Tag.TRAIN:
                        return self.take_batch(everyone)
                    return [SyncWeights(self.version, everyone, self.version)]
            case TrainFinished(step):
                self.finish_step(step)
                if not self.done:
                    return self._switch_all(Tag.ROLLOUT)
            case SyncFinished():
                return self.submit(self.config.batch_groups)
        return []

    def _switch_all(self, tag: Tag) -> list[Decision]:
        self._switching = set(self.trainers)
        return [SwitchTag(r, tag) for r in self.trainers]
