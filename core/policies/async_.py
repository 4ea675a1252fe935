"""`async`: separate pools; rollout of batch k+1 overlaps training of step k.

Models verl's one-step-off-policy pipeline and AReaL's bounded staleness: batch j may be generated
with weights of version >= j - max_staleness. Weights are synced between batches (never during a
generation), so a batch's tokens all share one version and the trained lag is at most the bound.
"""

from __future__ import annotations

from core.events import Decision, Event, GroupFinished, ResourceLost, Started, SyncFinished, TrainFinished
from core.policies.base import BasePolicy, PolicyConfig, split_pools
from core.tags import Resource


class AsyncPolicy(BasePolicy):
    name = "async"

    @staticmethod
    def layout(num_resources: int, train_fraction: float, devices: int) -> list[Resource]:
        rollout, train = split_pools(num_resources, train_fraction, devices)
        return rollout + train

    def __init__(self, resources, config: PolicyConfig) -> None:
        super().__init__(resources, config)
        self._generating = -1  # index of the batch being (or last) generated
        self._rollout_version = 0
        self._training = False

    def on_event(self, event: Event) -> list[Decision]:
        match event:
            case Started():
                self._generating = 0
                return self.submit(self.config.batch_groups)
            case GroupFinished(group_id, min_version):
                self.note_finished(group_id, min_version)
                if self.in_flight == 0:
                    return self._maybe_train() + self._feed_rollout()
            case TrainFinished(step):
                self.finish_step(step)
                self._training = False
                return self._maybe_train() + self._feed_rollout()
            case SyncFinished(version):
                self.synced(event)
                self._rollout_version = version
                return self._feed_rollout()
            case ResourceLost(resource):
                return self.lose(resource)
        return []

    def _maybe_train(self) -> list[Decision]:
        if self._training or self.done or len(self.ready) < self.config.batch_groups:
            return []
        self._training = True
        return self.take_batch(self.trainers)

    def _feed_rollout(self) -> list[Decision]:
        """Between batches: sync newer weights first, then generate the next batch if allowed."""
        if self.in_flight or self.syncing() or self.done:
            return []
        if self._rollout_version < self.version:
            return [self.sync(self.version, self.rollout_only, self.version)]
        nxt = self._generating + 1
        if nxt - self._rollout_version > self.config.max_staleness:
            return []
        self._generating = nxt
        return self.submit(self.config.batch_groups)
