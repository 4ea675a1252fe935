"""`disaggregated`: separate rollout and train pools, strictly on-policy.

Each pool waits for the other: the train pool idles while the batch is generated, the rollout pool
idles while it trains and while weights are broadcast.
"""

from __future__ import annotations

from core.events import Decision, Event, GroupFinished, ResourceLost, Started, SyncFinished, TrainFinished
from core.policies.base import BasePolicy, split_pools
from core.tags import Resource


class DisaggregatedPolicy(BasePolicy):
    name = "disaggregated"
    strictly_on_policy = True

    @staticmethod
    def layout(num_resources: int, train_fraction: float, devices: int) -> list[Resource]:
        rollout, train = split_pools(num_resources, train_fraction, devices)
        return rollout + train

    def on_event(self, event: Event) -> list[Decision]:
        match event:
            case Started():
                return self.submit(self.config.batch_groups)
            case GroupFinished(group_id, min_version):
                self.note_finished(group_id, min_version)
                if self.in_flight == 0:
                    return self.take_batch(self.trainers)
            case TrainFinished(step):
                self.finish_step(step)
                if not self.done:
                    return [self.sync(self.version, self.rollout_only, self.version)]
            case SyncFinished():
                self.synced(event)
                return self.submit(self.config.batch_groups)
            case ResourceLost(resource):
                return self.lose(resource)
        return []
