"""Tests for core.policies without the simulator: events in by hand, whole decision logs out.

Like SimPy's own tests, each scripted test asserts the complete log of (event, decisions) pairs, so a
decision that appears, disappears or changes order fails it. The seeded fake executor of
`core.fake` then replays decisions as completions in random orders, with every decision taking a
random time, to check the invariants every order must keep; with resources lost at random times too.
"""

from __future__ import annotations

import pytest

from core.errors import ContractError, RunFailed, UserError
from core.events import (
    GroupFinished,
    Preempt,
    PreemptFinished,
    Refresh,
    ResourceIdle,
    ResourceLost,
    ResumeRollout,
    Started,
    StartTrain,
    Submit,
    SwitchFinished,
    SwitchTag,
    SyncFinished,
    SyncWeights,
    TrainFinished,
)
from core.fake import FakeExecutor
from core.policies import POLICIES, PolicyConfig, make_policy, policy_class
from core.policies.base import split_pools
from core.policies.colocated import ColocatedPolicy
from core.policies.disaggregated import DisaggregatedPolicy
from core.tags import Resource, Tag

ROLLOUT, TRAIN = Tag.ROLLOUT, Tag.TRAIN


def drive(policy, events) -> list[tuple]:
    """The log of a scripted run: each event with the decisions the policy returned for it."""
    return [(event, policy.on_event(event)) for event in events]


def check(policy, script: list[tuple]) -> None:
    assert drive(policy, [event for event, _ in script]) == script


# ---- registry, layout, config ----


def test_registry_names_match_the_design():
    assert list(POLICIES) == ["colocated", "disaggregated", "async", "tag", "streaming"]
    for name, cls in POLICIES.items():
        assert policy_class(name) is cls and cls.name == name


def test_unknown_policy_lists_the_choices():
    choices = "async, colocated, disaggregated, streaming, tag"
    with pytest.raises(UserError, match=rf"unknown policy 'fifo'; valid choices: {choices}"):
        make_policy("fifo", PolicyConfig(batch_groups=1, num_steps=1), 4, 0.5, 1)


@pytest.mark.parametrize(
    ("num_resources", "fraction", "n_rollout", "n_train"),
    [(16, 0.5, 8, 8), (16, 0.25, 12, 4), (4, 0.01, 3, 1), (4, 0.99, 1, 3), (2, 0.5, 1, 1), (5, 0.5, 3, 2)],
)
def test_split_pools_rounds_to_whole_resources_and_keeps_both_pools(num_resources, fraction, n_rollout, n_train):
    rollout, train = split_pools(num_resources, fraction, devices=4)
    assert [r.name for r in rollout] == [f"R{i:02d}" for i in range(n_rollout)]
    assert [r.name for r in train] == [f"T{i:02d}" for i in range(n_train)]
    assert all(r.capabilities == {ROLLOUT} and r.devices == 4 for r in rollout)
    assert all(r.capabilities == {TRAIN} and r.devices == 4 for r in train)


@pytest.mark.parametrize(
    ("num_resources", "fraction", "message"),
    [
        (1, 0.5, "separate pools need at least 2 resources, got 1"),
        (4, 0.0, r"pools.train_fraction must be in \(0, 1\), got 0.0"),
        (4, 1.0, r"pools.train_fraction must be in \(0, 1\), got 1.0"),
        (4, -0.5, "got -0.5"),
    ],
)
def test_split_pools_errors(num_resources, fraction, message):
    with pytest.raises(UserError, match=message):
        split_pools(num_resources, fraction, devices=1)


def test_layouts_and_initial_tags():
    cfg = PolicyConfig(batch_groups=1, num_steps=1)
    colocated = make_policy("colocated", cfg, 3, 0.5, 8)
    assert [(r.name, r.tag_names, r.devices) for r in colocated.resources.values()] == [
        (f"C{i:02d}", ("rollout", "train"), 8) for i in range(3)
    ]
    tag = make_policy("tag", cfg, 4, 0.5, 2)
    assert {n: r.tag_names for n, r in tag.resources.items()} == {
        "R00": ("rollout",),
        "R01": ("rollout",),
        "T00": ("rollout", "train"),
        "T01": ("rollout", "train"),
    }
    assert tag.rollout_only == ("R00", "R01") and tag.trainers == ("T00", "T01")
    assert {n: tag.initial_active(n) for n in tag.resources} == dict.fromkeys(tag.resources, ROLLOUT)
    disagg = make_policy("disaggregated", cfg, 4, 0.5, 2)
    assert {n: disagg.initial_active(n) for n in disagg.resources} == {
        "R00": ROLLOUT,
        "R01": ROLLOUT,
        "T00": TRAIN,
        "T01": TRAIN,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_groups": 0, "num_steps": 1}, "policy.batch_groups must be >= 1, got 0"),
        ({"batch_groups": 1, "num_steps": 0}, "policy.num_steps must be >= 1, got 0"),
        ({"batch_groups": 1, "num_steps": 1, "max_staleness": -1}, "policy.max_staleness must be >= 0, got -1"),
        ({"batch_groups": 1, "num_steps": 1, "window_batches": 0}, "policy.window_batches must be >= 1, got 0"),
    ],
)
def test_policy_config_validation(kwargs, message):
    with pytest.raises(UserError, match=message):
        PolicyConfig(**kwargs)


def test_a_policy_needs_a_train_capable_resource():
    rollout_only = [Resource("R00", frozenset({ROLLOUT}), 1)]
    with pytest.raises(UserError, match="needs at least one train-capable resource"):
        DisaggregatedPolicy(rollout_only, PolicyConfig(batch_groups=1, num_steps=1))


def test_bookkeeping_rejects_impossible_events():
    policy = make_policy("disaggregated", PolicyConfig(batch_groups=1, num_steps=2), 2, 0.5, 1)
    with pytest.raises(RuntimeError, match="no group was in flight"):
        policy.on_event(GroupFinished(0, 0))
    policy.on_event(Started())
    policy.on_event(GroupFinished(0, 0))
    with pytest.raises(RuntimeError, match="train step 1 finished but step 0 was running"):
        policy.on_event(TrainFinished(1))


def test_take_batch_trains_the_oldest_versions_first_and_refreshes_stale_ones():
    policy = ColocatedPolicy(ColocatedPolicy.layout(1, 0.5, 1), PolicyConfig(batch_groups=2, num_steps=9))
    policy.step = policy.version = 3  # strictly on-policy: floor 3
    policy.ready.extend([(10, 3), (11, 2), (12, 4), (13, 3)])
    decisions = policy.take_batch(("C00",))
    # group 11 is stale (version 2 < 3): refreshed; then the two oldest admissible, in arrival order.
    assert decisions == [Refresh((11,), 3), StartTrain(3, (10, 13), ("C00",))]
    assert list(policy.ready) == [(12, 4)]
    assert policy.in_flight == 1 and policy.consumed == 2


# ---- scripted runs ----


def test_colocated_rolls_out_switches_trains_and_syncs_in_lock_step():
    policy = make_policy("colocated", PolicyConfig(batch_groups=2, num_steps=2), 2, 0.5, 4)
    both = ("C00", "C01")
    to_train = [SwitchTag("C00", TRAIN), SwitchTag("C01", TRAIN)]
    check(
        policy,
        [
            (Started(), [Submit(2)]),
            (GroupFinished(0, 0), []),
            (GroupFinished(1, 0), to_train),
            (SwitchFinished("C00", TRAIN), []),
            (SwitchFinished("C01", TRAIN), [StartTrain(0, (0, 1), both)]),
            (TrainFinished(0), [SwitchTag("C00", ROLLOUT), SwitchTag("C01", ROLLOUT)]),
            (SwitchFinished("C01", ROLLOUT), []),
            (SwitchFinished("C00", ROLLOUT), [SyncWeights(1, both, 1, 0)]),
            (SyncFinished(1, both, 0), [Submit(2)]),
            (GroupFinished(3, 1), []),
            (GroupFinished(2, 1), to_train),
            (SwitchFinished("C00", TRAIN), []),
            (SwitchFinished("C01", TRAIN), [StartTrain(1, (3, 2), both)]),  # in the order they finished
            (TrainFinished(1), []),  # the last step: no switch back
        ],
    )
    assert policy.done and policy.submitted == policy.consumed == 4


def test_disaggregated_pools_wait_for_each_other():
    policy = make_policy("disaggregated", PolicyConfig(batch_groups=2, num_steps=2), 4, 0.5, 2)
    rollout, train = ("R00", "R01"), ("T00", "T01")
    check(
        policy,
        [
            (Started(), [Submit(2)]),
            (GroupFinished(1, 0), []),
            (GroupFinished(0, 0), [StartTrain(0, (1, 0), train)]),
            (TrainFinished(0), [SyncWeights(1, rollout, 1, 0)]),  # nothing is generated while it trains
            (SyncFinished(1, rollout, 0), [Submit(2)]),
            (GroupFinished(2, 1), []),
            (GroupFinished(3, 1), [StartTrain(1, (2, 3), train)]),
            (TrainFinished(1), []),
        ],
    )
    assert policy.done


def test_async_generates_one_batch_ahead_and_syncs_between_batches():
    policy = make_policy("async", PolicyConfig(batch_groups=2, num_steps=3), 4, 0.5, 2)
    rollout, train = ("R00", "R01"), ("T00", "T01")
    check(
        policy,
        [
            (Started(), [Submit(2)]),  # batch 0 with version 0
            (GroupFinished(0, 0), []),
            (GroupFinished(1, 0), [StartTrain(0, (0, 1), train), Submit(2)]),  # batch 1 with version 0: lag 1
            (GroupFinished(2, 0), []),
            (GroupFinished(3, 0), []),  # batch 2 would need version >= 1: wait
            (TrainFinished(0), [StartTrain(1, (2, 3), train), SyncWeights(1, rollout, 1, 0)]),
            (SyncFinished(1, rollout, 0), [Submit(2)]),  # batch 2 with version 1
            (GroupFinished(4, 1), []),
            (GroupFinished(5, 1), []),  # batch 3 would need version >= 2: wait
            (TrainFinished(1), [StartTrain(2, (4, 5), train), SyncWeights(2, rollout, 2, 1)]),
            (SyncFinished(2, rollout, 1), [Submit(2)]),  # keeps generating past the last measured step
            (TrainFinished(2), []),
        ],
    )
    assert policy.done


def test_async_with_zero_staleness_decides_like_disaggregated():
    cfg = PolicyConfig(batch_groups=2, num_steps=2, max_staleness=0)
    events = [
        Started(),
        GroupFinished(0, 0),
        GroupFinished(1, 0),
        TrainFinished(0),
        SyncFinished(1, ("R00", "R01"), 0),
        GroupFinished(2, 1),
        GroupFinished(3, 1),
        TrainFinished(1),
    ]
    asynchronous = drive(make_policy("async", cfg, 4, 0.5, 1), events)
    assert asynchronous == drive(make_policy("disaggregated", cfg, 4, 0.5, 1), events)


def test_tag_multiplexes_train_resources_and_keeps_the_staleness_bound():
    """Window 1 + max_staleness = 2 batches counting the one training; a full batch preempts the
    train resources, each switches to training once its preemption finished; a step syncs
    rollout-only resources (pausing them) and resumes them; a group that fell out of the bound is
    refreshed; when no batch is ready the trainers go back to rollout."""
    policy = make_policy("tag", PolicyConfig(batch_groups=2, num_steps=3, fill_idle=True), 2, 0.5, 1)
    r, t = ("R00",), ("T00",)
    check(
        policy,
        [
            (Started(), [Submit(4)]),  # groups 0-3: two batches
            (GroupFinished(0, 0), []),
            (GroupFinished(1, 0), [Preempt("T00")]),
            (GroupFinished(2, 0), []),
            (PreemptFinished("T00"), [SwitchTag("T00", TRAIN)]),
            # Training batch 0 plus batches in flight or ready fill the window: submit nothing yet (a
            # third batch generated with version 0 could never be trained within lag 1).
            (SwitchFinished("T00", TRAIN), [StartTrain(0, (0, 1), t)]),
            (GroupFinished(3, 0), []),
            (TrainFinished(0), [SyncWeights(1, r, 0, 0), StartTrain(1, (2, 3), t), Submit(2)]),
            (SyncFinished(1, r, 0), [ResumeRollout(r)]),
            (GroupFinished(4, 0), []),  # holds a token of version 0: fine for step 1, too old for step 2
            (GroupFinished(5, 1), []),
            (TrainFinished(1), [Refresh((4,), 1), SyncWeights(2, r, 1, 1), Submit(2), SwitchTag("T00", ROLLOUT)]),
            (SyncFinished(2, r, 1), [ResumeRollout(r)]),
            (SwitchFinished("T00", ROLLOUT), [SyncWeights(2, t, 1, 2)]),
            (ResourceIdle("R00"), [Submit(1)]),  # its device share of a batch beyond the window
            (SyncFinished(2, t, 2), [ResumeRollout(t)]),
            (GroupFinished(4, 2), [Preempt("T00")]),  # the refreshed group is back
            (PreemptFinished("T00"), [SwitchTag("T00", TRAIN)]),
            (SwitchFinished("T00", TRAIN), [StartTrain(2, (5, 4), t)]),
            (TrainFinished(2), []),
            (ResourceIdle("R00"), []),  # done: no more filling
        ],
    )
    assert policy.done and policy.submitted == 9 and policy.consumed == 6


def test_tag_tells_syncs_apart_by_id_and_never_overlaps_two_on_a_resource():
    """A step that ends while the rollout-only resources still load older weights does not start a
    second sync on them: the newer weights follow when the first sync finishes, and the trainers'
    own sync (told apart by its id, not by its resources) is what returns them to rollout."""
    policy = make_policy("tag", PolicyConfig(batch_groups=1, num_steps=4), 2, 0.5, 1)
    r, t = ("R00",), ("T00",)
    check(
        policy,
        [
            (Started(), [Submit(2)]),
            (GroupFinished(0, 0), [Preempt("T00")]),
            (PreemptFinished("T00"), [SwitchTag("T00", TRAIN)]),
            (SwitchFinished("T00", TRAIN), [StartTrain(0, (0,), t)]),
            (TrainFinished(0), [SyncWeights(1, r, 0, 0), Submit(1), SwitchTag("T00", ROLLOUT)]),
            (GroupFinished(1, 0), []),
            (SwitchFinished("T00", ROLLOUT), [SyncWeights(1, t, 0, 1)]),
            (SyncFinished(1, t, 1), [ResumeRollout(t), Preempt("T00")]),
            (PreemptFinished("T00"), [SwitchTag("T00", TRAIN)]),
            (SwitchFinished("T00", TRAIN), [StartTrain(1, (1,), t)]),
            (TrainFinished(1), [Submit(1), SwitchTag("T00", ROLLOUT)]),  # R00 still syncing: no second sync
            (SyncFinished(1, r, 0), [SyncWeights(2, r, 1, 2)]),  # version 2 exists now: load it, then resume
            (SyncFinished(2, r, 2), [ResumeRollout(r)]),
        ],
    )


def test_tag_leaves_idle_resources_alone_unless_fill_idle():
    policy = make_policy("tag", PolicyConfig(batch_groups=2, num_steps=3), 2, 0.5, 1)
    assert policy.on_event(Started()) == [Submit(4)]
    assert policy.on_event(ResourceIdle("R00")) == []


def test_tag_with_a_larger_bound_keeps_a_larger_window():
    policy = make_policy("tag", PolicyConfig(batch_groups=2, num_steps=5, max_staleness=2), 2, 0.5, 1)
    assert drive(policy, [Started()]) == [(Started(), [Submit(6)])]
    explicit = make_policy("tag", PolicyConfig(batch_groups=2, num_steps=5, window_batches=1), 2, 0.5, 1)
    assert drive(explicit, [Started()]) == [(Started(), [Submit(2)])]


# ---- lost resources ----


def test_colocated_carries_on_without_a_resource_lost_while_switching_or_training():
    policy = make_policy("colocated", PolicyConfig(batch_groups=1, num_steps=2), 3, 0.5, 1)
    check(
        policy,
        [
            (Started(), [Submit(1)]),
            (GroupFinished(0, 0), [SwitchTag("C00", TRAIN), SwitchTag("C01", TRAIN), SwitchTag("C02", TRAIN)]),
            (SwitchFinished("C00", TRAIN), []),
            (SwitchFinished("C02", TRAIN), []),
            (ResourceLost("C01"), [StartTrain(0, (0,), ("C00", "C02"))]),  # its switch will never finish
            (ResourceLost("C02"), [StartTrain(0, (0,), ("C00",))]),  # the step again, on the survivor
            (TrainFinished(0), [SwitchTag("C00", ROLLOUT)]),
        ],
    )
    assert policy.lost == ["C01", "C02"] and policy.trainers == ("C00",)


def test_a_sync_is_issued_again_on_the_resources_that_survive():
    policy = make_policy("disaggregated", PolicyConfig(batch_groups=1, num_steps=2), 4, 0.5, 1)
    rollout = ("R00", "R01")
    check(
        policy,
        [
            (Started(), [Submit(1)]),
            (GroupFinished(0, 0), [StartTrain(0, (0,), ("T00", "T01"))]),
            (TrainFinished(0), [SyncWeights(1, rollout, 1, 0)]),
            (ResourceLost("R00"), [SyncWeights(1, ("R01",), 1, 1)]),
            (SyncFinished(1, ("R01",), 1), [Submit(1)]),
        ],
    )


def test_tag_rolls_out_on_its_train_resources_alone_once_every_rollout_only_one_is_lost():
    """A sync whose every resource was lost is over: nothing is left to resume, and later steps sync
    no rollout-only resource."""
    policy = make_policy("tag", PolicyConfig(batch_groups=1, num_steps=3), 2, 0.5, 1)
    t = ("T00",)
    check(
        policy,
        [
            (Started(), [Submit(2)]),
            (GroupFinished(0, 0), [Preempt("T00")]),
            (PreemptFinished("T00"), [SwitchTag("T00", TRAIN)]),
            (SwitchFinished("T00", TRAIN), [StartTrain(0, (0,), t)]),
            (TrainFinished(0), [SyncWeights(1, ("R00",), 0, 0), Submit(1), SwitchTag("T00", ROLLOUT)]),
            (ResourceLost("R00"), []),
            (SwitchFinished("T00", ROLLOUT), [SyncWeights(1, t, 0, 1)]),
            (SyncFinished(1, t, 1), [ResumeRollout(t)]),
            (GroupFinished(1, 0), [Preempt("T00")]),
            (PreemptFinished("T00"), [SwitchTag("T00", TRAIN)]),
            (SwitchFinished("T00", TRAIN), [StartTrain(1, (1,), t)]),
            (TrainFinished(1), [Submit(1), SwitchTag("T00", ROLLOUT)]),
        ],
    )
    assert policy.rollout_only == () and not policy.syncing()


@pytest.mark.parametrize(
    ("name", "lost", "message"),
    [
        ("disaggregated", ["T00"], "policy 'disaggregated' has no train-capable resource left (lost: T00)"),
        ("async", ["R00"], "policy 'async' has no rollout-capable resource left (lost: R00)"),
        ("tag", ["R00", "T00"], "policy 'tag' has no train-capable resource left (lost: R00, T00)"),
        ("colocated", ["C01", "C00"], "policy 'colocated' has no train-capable resource left (lost: C01, C00)"),
    ],
)
def test_losing_every_resource_of_a_role_fails_the_run_naming_them(name, lost, message):
    policy = make_policy(name, PolicyConfig(batch_groups=1, num_steps=2), 2, 0.5, 1)
    policy.on_event(Started())
    for resource in lost[:-1]:
        policy.on_event(ResourceLost(resource))
    with pytest.raises(RunFailed, match=message.replace("(", r"\(").replace(")", r"\)")):
        policy.on_event(ResourceLost(lost[-1]))


def test_a_sync_finishing_twice_or_an_unknown_loss_breaks_the_contract():
    policy = make_policy("disaggregated", PolicyConfig(batch_groups=1, num_steps=2), 2, 0.5, 1)
    with pytest.raises(ContractError, match=r"completes no sync in flight \(ids \[\]\)"):
        policy.on_event(SyncFinished(1, ("R00",), 7))
    with pytest.raises(ContractError, match="lost resource 'X09' is not in the pools"):
        policy.on_event(ResourceLost("X09"))


# ---- random completion orders ----


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("name", list(POLICIES))
def test_any_completion_order_trains_every_step_within_the_staleness_bound(name, max_staleness, seed):
    cfg = PolicyConfig(batch_groups=3, num_steps=6, max_staleness=max_staleness)
    policy = make_policy(name, cfg, num_resources=4, train_fraction=0.5, devices=2)
    executor = FakeExecutor(policy, seed)
    executor.run()
    assert executor.steps == list(range(6))
    bound = 0 if policy.strictly_on_policy else max_staleness
    assert executor.lags
    assert max(executor.lags) <= bound
    if name == "async":
        # batch j may only be generated with weights of version >= j - max_staleness
        assert all(j - version <= max_staleness for j, version in enumerate(executor.submits))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("name", list(POLICIES))
def test_a_draining_run_submits_only_the_groups_its_steps_train(name, max_staleness, seed):
    steps, batch = 6, 3
    kept = PolicyConfig(batch_groups=batch, num_steps=steps, max_staleness=max_staleness)
    drained = PolicyConfig(batch_groups=batch, num_steps=steps, max_staleness=max_staleness, drain=True)
    submitted = {}
    for label, cfg in (("kept", kept), ("drained", drained)):
        policy = make_policy(name, cfg, num_resources=4, train_fraction=0.5, devices=2)
        executor = FakeExecutor(policy, seed)
        executor.run()
        assert executor.steps == list(range(steps))
        assert max(executor.lags) <= (0 if policy.strictly_on_policy else max_staleness)
        submitted[label] = policy.submitted
    assert submitted["drained"] == steps * batch  # fresh groups; stale ones are regenerated, not resubmitted
    assert submitted["kept"] >= steps * batch
    if name in ("tag", "streaming") and max_staleness:  # a window beyond one batch generates past the last step
        assert submitted["kept"] > steps * batch


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("name", list(POLICIES))
def test_runs_survive_losing_a_train_and_a_rollout_resource_at_random_times(name, seed):
    """Whatever each was doing (preempting, switching, training, syncing, rolling out), the run
    goes on without it and keeps the staleness bound."""
    cfg = PolicyConfig(batch_groups=3, num_steps=6, max_staleness=1)
    policy = make_policy(name, cfg, num_resources=4, train_fraction=0.5, devices=2)
    executor = FakeExecutor(policy, seed)
    trainer, other = policy.trainers[seed % 2], ("C03" if name == "colocated" else "R01")
    # within 10 fake seconds: the fastest policy's run (streaming's) may end soon after
    executor.lose(trainer, at_s=executor.rng.uniform(0.5, 10.0))
    executor.lose(other, at_s=executor.rng.uniform(0.5, 10.0))
    executor.run()
    assert executor.steps == list(range(6))
    assert sorted(policy.lost) == sorted([trainer, other])
    assert max(executor.lags) <= (0 if policy.strictly_on_policy else 1)


@pytest.mark.parametrize("seed", range(6))
def test_tag_survives_losing_every_rollout_only_resource_at_random_times(seed):
    policy = make_policy(
        "tag", PolicyConfig(batch_groups=3, num_steps=6), num_resources=4, train_fraction=0.5, devices=2
    )
    executor = FakeExecutor(policy, seed)
    for resource in ("R00", "R01"):
        executor.lose(resource, at_s=executor.rng.uniform(0.5, 15.0))
    executor.run()
    assert executor.steps == list(range(6))
    assert policy.rollout_only == ()
    assert max(executor.lags) <= 1
