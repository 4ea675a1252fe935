"""`async` with a staleness bound k: generation runs up to k batches ahead of training.

The policy on its own (a scripted decision log, and random completion orders through the fake
executor), then whole simulations: the lag of trained tokens never exceeds k, reaches k when the
rollout pool outpaces training, and a larger bound changes the result on a rollout-bound config.
"""

from __future__ import annotations

import pytest

from core.events import (
    GroupFinished,
    Started,
    StartTrain,
    Submit,
    SyncFinished,
    SyncWeights,
    TrainFinished,
)
from core.fake import FakeExecutor
from core.metrics import summarize
from core.policies import PolicyConfig, make_policy

# Rollout outpaces training: short answers to long prompts, and 2 train resources against 14
# rollout ones, so the trainer is the bottleneck and the rollout pool waits for it.
ROLLOUT_FASTER = (
    "num_steps=8",
    "workload.response_tokens.median=300",
    "workload.prompt_tokens.median=1500",
    "pools.train_fraction=0.125",
)


def lags(timeline) -> set[int]:
    return {lag for step in timeline.steps for lag, tokens in step.lag_tokens.items() if tokens}


# ---- the policy ----


def test_async_with_bound_two_keeps_two_batches_ahead_and_syncs_only_a_drained_pool():
    """Batches 0 and 1 start together; batch 2 starts once the trainer took batch 0, still with
    version 0 (lag 2 when step 2 trains it); batch 3 needs version >= 1, so it waits until the pool
    has drained, and both syncs land first (the newest weights go to the pool before it restarts)."""
    policy = make_policy("async", PolicyConfig(batch_groups=1, num_steps=4, max_staleness=2), 4, 0.5, 1)
    rollout, train = ("R00", "R01"), ("T00", "T01")
    script = [
        (Started(), [Submit(1), Submit(1)]),
        (GroupFinished(1, 0), [StartTrain(0, (1,), train), Submit(1)]),  # the first group to finish
        (TrainFinished(0), []),  # batch 3 may not start before the trainer took batch 1
        (GroupFinished(0, 0), [StartTrain(1, (0,), train)]),  # batch 3 would need version >= 1
        (GroupFinished(2, 0), [SyncWeights(1, rollout, 1, 0)]),  # drained: load the newest weights
        (TrainFinished(1), [StartTrain(2, (2,), train)]),  # lag 2
        (SyncFinished(1, rollout, 0), [SyncWeights(2, rollout, 2, 1)]),  # still drained: newer ones
        (SyncFinished(2, rollout, 1), [Submit(1), Submit(1)]),  # batches 3 and 4 with version 2
        (GroupFinished(3, 2), []),
        (TrainFinished(2), [StartTrain(3, (3,), train)]),
        (TrainFinished(3), []),
    ]
    assert [(event, policy.on_event(event)) for event, _ in script] == script
    assert policy.done


class RecordingFake(FakeExecutor):
    """The fake executor, also counting the groups sent back to be regenerated."""

    refreshed = 0

    def refresh(self, d) -> None:
        self.refreshed += len(d.group_ids)
        super().refresh(d)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_any_completion_order_keeps_the_bound_without_regenerating(max_staleness, seed):
    cfg = PolicyConfig(batch_groups=3, num_steps=9, max_staleness=max_staleness)
    policy = make_policy("async", cfg, num_resources=4, train_fraction=0.5, devices=2)
    executor = RecordingFake(policy, seed)
    executor.run()
    assert executor.steps == list(range(9))
    assert max(executor.lags) <= max_staleness
    assert executor.refreshed == 0  # trained oldest first: no group ever falls out of the bound
    assert all(batch - version <= max_staleness for batch, version in enumerate(executor.submits))


# ---- whole simulations ----


@pytest.mark.parametrize("kind", ["math", "swe"])
@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_trained_tokens_never_lag_more_than_the_bound(run_small, kind, max_staleness):
    timeline = run_small("async", f"workload.kind={kind}", f"policy.max_staleness={max_staleness}", "num_steps=6")
    assert max(lags(timeline)) <= max_staleness
    assert timeline.counters.get("wasted_tokens", 0) == 0  # nothing is regenerated


@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_the_lag_reaches_the_bound_when_rollout_outpaces_training(run_small, max_staleness):
    timeline = run_small("async", *ROLLOUT_FASTER, f"policy.max_staleness={max_staleness}")
    summary = summarize(timeline)
    assert summary["pool_utilisation"]["train"] > summary["pool_utilisation"]["rollout"]  # the premise
    assert max(lags(timeline)) == max_staleness
    hist = summary["staleness"]["histogram"]
    assert max(hist, key=hist.get) == str(max_staleness)  # most tokens are as stale as allowed


def test_a_larger_bound_changes_a_rollout_bound_run(run_small):
    """The default long-tailed lengths keep the rollout pool the bottleneck: with k = 2 a second
    batch fills the engines during the first one's tail, so more tokens are trained per second and
    they are older."""
    one, two = (summarize(run_small("async", f"policy.max_staleness={k}", "num_steps=6")) for k in (1, 2))
    assert two["token_throughput"] > 1.2 * one["token_throughput"]
    assert one["staleness"]["max_lag"] == 1
    assert two["staleness"]["max_lag"] == 2
    assert two["staleness"]["mean_lag"] > one["staleness"]["mean_lag"]
    assert two["pool_utilisation"]["rollout"] > one["pool_utilisation"]["rollout"]


def test_bound_one_still_generates_one_batch_at_a_time(run_small):
    """k = 1 is verl's one-step-off pipeline: a batch's generation overlaps the previous step only,
    so the rollout pool holds one batch at a time and each sync follows a drained pool."""
    timeline = run_small("async", "num_steps=6")
    assert lags(timeline) == {0, 1}
    assert summarize(timeline)["sync_time_s"]["count"] == 5  # one after each step but the last
