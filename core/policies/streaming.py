"""`streaming`: fully asynchronous RL in the manner of AReaL: rollout never waits for training.

Separate pools, as in `async`, but no batch boundaries on the rollout side:

- **Rollout never stops.** Groups are started whenever there is room, not batch by batch. Room is
  bounded as AReaL bounds it: at most `(1 + max_staleness)` batches' worth of groups are in flight,
  finished-and-waiting or training (AReaL admits a request only while the trajectories generated so
  far number at most `(version + 1 + max_staleness) x batch`). Without the bound generation would
  run ahead of training and most of it would go stale.
- **The trainer streams.** As soon as `batch_groups` finished groups are admissible it trains them,
  oldest versions first (those are the next to fall out of the bound); it does not wait for the
  groups started together with them.
- **Weights are pushed after every step, with partial rollout.** The rollout engines pause at a
  token boundary, load the new version and resume every request from its prefix, so one sample's
  tokens can carry several versions. A step that ends while a push is still loading is followed by
  the newest version as soon as that push lands (an engine never runs two syncs at once).
- **Per-token staleness.** A token generated under version v may be trained at step s only if
  s - v <= max_staleness (eta). A push restarts from its prompt every in-flight request holding a
  token older than `version - eta`: it could never be trained within the bound. A finished group
  that fell out of the bound before the trainer reached it is handled by `stale_samples`:

  - `regenerate` (the default): its samples holding a too-old token are generated afresh; its
    other samples are kept, so the group stays whole (GRPO's advantages are relative to the group)
    and only the stale part of the work is lost.
  - `drop`: the whole group is discarded and a new group takes its place in the window. The
    executor is not told (the events contract has no decision for discarding finished groups), so
    it keeps the dropped group's record; the policy lists the ids in `dropped` for accounting.

Departure from AReaL: AReaL bounds staleness where requests are admitted and trains what comes back
with a decoupled PPO objective; here the bound is also enforced per token when a batch is taken, so
a long-tailed sample that outlives it is regenerated (or dropped) rather than trained.
"""

from __future__ import annotations

from collections import deque

from core.events import (
    Decision,
    Event,
    GroupFinished,
    ResourceLost,
    ResumeRollout,
    Started,
    SyncFinished,
    TrainFinished,
)
from core.policies.base import BasePolicy, PolicyConfig, split_pools
from core.tags import Resource


class StreamingPolicy(BasePolicy):
    name = "streaming"

    @staticmethod
    def layout(num_resources: int, train_fraction: float, devices: int) -> list[Resource]:
        rollout, train = split_pools(num_resources, train_fraction, devices)
        return rollout + train

    def __init__(self, resources, config: PolicyConfig) -> None:
        super().__init__(resources, config)
        self.window = config.batch_groups * (1 + config.max_staleness)
        self.dropped: list[int] = []  # finished groups discarded as stale (`stale_samples: drop`)

    def on_event(self, event: Event) -> list[Decision]:
        match event:
            case Started():
                return self._top_up()
            case GroupFinished(group_id, min_version):
                self.note_finished(group_id, min_version)
                return self._maybe_train() + self._top_up()
            case TrainFinished(step):
                return self._after_step(step)
            case SyncFinished():
                return self._synced(event)
            case ResourceLost(resource):
                return self.lose(resource)
        return []  # ResourceIdle: the window is full; more work now would only go stale

    def _top_up(self) -> list[Decision]:
        """Keep the window full: `1 + max_staleness` batches in flight, finished or training."""
        if self.done:
            return []
        training = self.config.batch_groups if self.running is not None else 0
        return self.submit(self.window - training)

    def _maybe_train(self) -> list[Decision]:
        """Train the oldest admissible groups as soon as a batch of them is ready."""
        if self.running is not None or self.done:
            return []
        decisions = self._discard_stale()
        if len(self.ready) < self.config.batch_groups:
            return decisions
        return decisions + self.take_batch(self.trainers)

    def _discard_stale(self) -> list[Decision]:
        """Finished groups holding a token too old for the next step: regenerate or drop them."""
        if self.config.stale_samples == "regenerate":
            return self.refresh_stale()
        floor = self.step - self.staleness_bound
        stale = [g for g, v in self.ready if v < floor]
        if stale:
            self.ready = deque((g, v) for g, v in self.ready if v >= floor)
            self.dropped += stale
        return []

    def _after_step(self, step: int) -> list[Decision]:
        """Push the new weights to the rollout engines, then train the next batch if one is ready."""
        self.finish_step(step)
        if self.done:
            return []
        decisions: list[Decision] = []
        if self.rollout_only and not self.syncing():  # else it follows when the running push lands
            decisions.append(self._push())
        return decisions + self._maybe_train() + self._top_up()

    def _push(self) -> Decision:
        """Load the newest version onto the rollout engines; requests holding a token older than
        `version - max_staleness` restart (they can never be trained within the bound)."""
        return self.sync(self.version, self.rollout_only, self.version - self.config.max_staleness)

    def _synced(self, event: SyncFinished) -> list[Decision]:
        self.synced(event)
        if event.version < self.version and self.rollout_only and not self.done:
            return [self._push()]  # a step ended meanwhile: the engines stay paused for the newer weights
        return [ResumeRollout(event.resources)] if event.resources else []
