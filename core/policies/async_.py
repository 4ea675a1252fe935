"""`async`: separate pools; generation runs up to `max_staleness` batches ahead of training.

Models verl's one-step-off-policy pipeline (`max_staleness` 1) and its generalisation to a bound of
k batches. Batch i may start generating once the trainer has taken batch i - k (so while it is still
on batch i - k .. i - 1), and only with weights of version >= i - k: at most k batches are generated
or wait for the trainer beyond the one it trains. With k = 1 this is one batch at a time, each
overlapping the previous batch's training; with k >= 2 several batches are in flight together, so
the long tail of one batch shares the engines with the next one's requests.

Weights are synced only while the rollout pool holds no request (never during a generation), so all
tokens of a group share one version. A batch that needs newer weights than the pool holds waits for
the pool to drain and the sync to land. The trainer takes the `batch_groups` finished groups of the
oldest versions; since every group in flight holds the newest version of any group and batch i was
generated with version >= i - k, that order trains every group within the bound without
regenerating any (the shared `take_batch` would refresh one that fell out of it).
"""

from __future__ import annotations

from core.events import (
    Decision,
    Event,
    GroupFinished,
    ResourceLost,
    Started,
    Submit,
    SyncFinished,
    TrainFinished,
)
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
        self._batches = 0  # batches submitted so far; the next one has index `_batches`
        self._taken = 0  # batches the trainer has taken (trained or training)
        self._rollout_version = 0  # the weights the rollout pool holds
        self._training = False

    def on_event(self, event: Event) -> list[Decision]:
        match event:
            case Started():
                return self._feed_rollout()
            case GroupFinished(group_id, min_version):
                self.note_finished(group_id, min_version)
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

    @property
    def ahead(self) -> int:
        """Batches that may be generated or wait beyond the one training (at least one, so a bound
        of 0 still generates the next batch, on-policy, like `disaggregated`)."""
        return max(1, self.config.max_staleness)

    def _maybe_train(self) -> list[Decision]:
        if self._training or self.done or len(self.ready) < self.config.batch_groups:
            return []
        self._training = True
        self._taken += 1
        return self.take_batch(self.trainers)

    def _feed_rollout(self) -> list[Decision]:
        """Start every batch the bound allows now; once the pool has drained, load newer weights
        first (a batch waiting for them starts when the sync lands)."""
        if self.syncing() or self.done:
            return []
        if self.in_flight == 0 and self._rollout_version < self.version:
            return [self.sync(self.version, self.rollout_only, self.version)]
        decisions: list[Decision] = []
        while self._may_start(self._batches):
            decisions.append(self._submit_batch())
        return decisions

    def _may_start(self, batch: int) -> bool:
        """Batch `batch` may start once the trainer took batch `batch - ahead`, and only with
        weights of version >= `batch - max_staleness`; with `drain`, only a batch a step will take."""
        if self.config.drain and batch >= self.config.num_steps:
            return False
        return batch < self._taken + self.ahead and batch - self._rollout_version <= self.config.max_staleness

    def _submit_batch(self) -> Decision:
        """One `Submit` per batch, so an executor sees the batches it is asked to start one by one."""
        self._batches += 1
        self.in_flight += self.config.batch_groups
        self.submitted += self.config.batch_groups
        return Submit(self.config.batch_groups)
