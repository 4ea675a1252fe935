"""Tests for core.policies without the simulator: events in by hand, whole decision logs out.

Like SimPy's own tests, each scripted test asserts the complete log of (event, decisions) pairs, so a
decision that appears, disappears or changes order fails it. A seeded fake executor then replays
decisions as completions in random orders to check the invariants every order must keep.
"""

from __future__ import annotations

import heapq
import random
from itertools import count

import pytest

from core.errors import UserError
from core.events import (
    GroupFinished,
    PauseRollout,
    Preempt,
    Refresh,
    ResourceIdle,
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
    assert list(POLICIES) == ["colocated", "disaggregated", "async", "tag"]
    for name, cls in POLICIES.items():
        assert policy_class(name) is cls and cls.name == name


def test_unknown_policy_lists_the_choices():
    with pytest.raises(UserError, match=r"unknown policy 'fifo'; valid choices: async, colocated, disaggregated, tag"):
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
            (SwitchFinished("C00", ROLLOUT), [SyncWeights(1, both, 1)]),
            (SyncFinished(1, both), [Submit(2)]),
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
            (TrainFinished(0), [SyncWeights(1, rollout, 1)]),  # nothing is generated while it trains
            (SyncFinished(1, rollout), [Submit(2)]),
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
            (TrainFinished(0), [StartTrain(1, (2, 3), train), SyncWeights(1, rollout, 1)]),
            (SyncFinished(1, rollout), [Submit(2)]),  # batch 2 with version 1
            (GroupFinished(4, 1), []),
            (GroupFinished(5, 1), []),  # batch 3 would need version >= 2: wait
            (TrainFinished(1), [StartTrain(2, (4, 5), train), SyncWeights(2, rollout, 2)]),
            (SyncFinished(2, rollout), [Submit(2)]),  # keeps generating past the last measured step
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
        SyncFinished(1, ("R00", "R01")),
        GroupFinished(2, 1),
        GroupFinished(3, 1),
        TrainFinished(1),
    ]
    asynchronous = drive(make_policy("async", cfg, 4, 0.5, 1), events)
    assert asynchronous == drive(make_policy("disaggregated", cfg, 4, 0.5, 1), events)


def test_tag_multiplexes_train_resources_and_keeps_the_staleness_bound():
    """Window 1 + max_staleness = 2 batches counting the one training; a full batch preempts the
    train resources; a step pauses, syncs and resumes rollout-only resources; a group that fell out
    of the bound is refreshed; when no batch is ready the trainers go back to rollout."""
    policy = make_policy("tag", PolicyConfig(batch_groups=2, num_steps=3, fill_idle=True), 2, 0.5, 1)
    r, t = ("R00",), ("T00",)
    check(
        policy,
        [
            (Started(), [Submit(4)]),  # groups 0-3: two batches
            (GroupFinished(0, 0), []),
            (GroupFinished(1, 0), [Preempt("T00"), SwitchTag("T00", TRAIN)]),
            (GroupFinished(2, 0), []),
            # Training batch 0 plus batches in flight or ready fill the window: submit nothing yet (a
            # third batch generated with version 0 could never be trained within lag 1).
            (SwitchFinished("T00", TRAIN), [StartTrain(0, (0, 1), t)]),
            (GroupFinished(3, 0), []),
            (TrainFinished(0), [PauseRollout(r), SyncWeights(1, r, 0), StartTrain(1, (2, 3), t), Submit(2)]),
            (SyncFinished(1, r), [ResumeRollout(r)]),
            (GroupFinished(4, 0), []),  # holds a token of version 0: fine for step 1, too old for step 2
            (GroupFinished(5, 1), []),
            (
                TrainFinished(1),
                [Refresh((4,), 1), PauseRollout(r), SyncWeights(2, r, 1), Submit(2), SwitchTag("T00", ROLLOUT)],
            ),
            (SyncFinished(2, r), [ResumeRollout(r)]),
            (SwitchFinished("T00", ROLLOUT), [SyncWeights(2, t, 1)]),
            (ResourceIdle("R00"), [Submit(1)]),  # its device share of a batch beyond the window
            (SyncFinished(2, t), [ResumeRollout(t)]),
            (GroupFinished(4, 2), [Preempt("T00"), SwitchTag("T00", TRAIN)]),  # the refreshed group is back
            (SwitchFinished("T00", TRAIN), [StartTrain(2, (5, 4), t)]),
            (TrainFinished(2), []),
            (ResourceIdle("R00"), []),  # done: no more filling
        ],
    )
    assert policy.done and policy.submitted == 9 and policy.consumed == 6


def test_tag_leaves_idle_resources_alone_unless_fill_idle():
    policy = make_policy("tag", PolicyConfig(batch_groups=2, num_steps=3), 2, 0.5, 1)
    assert policy.on_event(Started()) == [Submit(4)]
    assert policy.on_event(ResourceIdle("R00")) == []


def test_tag_with_a_larger_bound_keeps_a_larger_window():
    policy = make_policy("tag", PolicyConfig(batch_groups=2, num_steps=5, max_staleness=2), 2, 0.5, 1)
    assert drive(policy, [Started()]) == [(Started(), [Submit(6)])]
    explicit = make_policy("tag", PolicyConfig(batch_groups=2, num_steps=5, window_batches=1), 2, 0.5, 1)
    assert drive(explicit, [Started()]) == [(Started(), [Submit(2)])]


# ---- random completion orders ----


class FakeExecutor:
    """Replays a policy's decisions as completion events after seeded random delays.

    No physics: a group's tokens all come from the weights its rollout pool holds when it starts
    (or restarts). Sync restarts in-flight groups older than `min_keep_version`, as the simulator
    does. Records the lag of every trained group and the rollout version behind every Submit.
    """

    def __init__(self, policy, seed: int) -> None:
        self.policy, self.rng = policy, random.Random(seed)
        self.now, self._seq, self._heap = 0.0, count(), []
        self.weights = dict.fromkeys(policy.resources, 0)
        self.rollout_pool = policy.rollout_only or policy.trainers
        self.group_version: dict[int, int] = {}  # in flight -> version it is generated with
        self.finished_version: dict[int, int] = {}
        self._token: dict[int, int] = {}  # invalidates the completion of a restarted group
        self.next_gid = 0
        self.trained: list[int] = []
        self.steps: list[int] = []
        self.lags: list[int] = []
        self.submits: list[int] = []  # rollout version at each Submit

    def rollout_version(self) -> int:
        return min(self.weights[r] for r in self.rollout_pool)

    def _later(self, item) -> None:
        heapq.heappush(self._heap, (self.now + self.rng.uniform(0.1, 2.0), next(self._seq), item))

    def _start_group(self, gid: int) -> None:
        self.group_version[gid] = self.rollout_version()
        self._token[gid] = self._token.get(gid, 0) + 1
        self._later(("group", gid, self._token[gid]))

    def run(self, max_events: int = 20_000) -> None:
        self.deliver(Started())
        for _ in range(max_events):
            if self.policy.done:
                return
            assert self._heap, "the policy waits for an event that cannot come"
            self.now, _, item = heapq.heappop(self._heap)
            if item[0] == "group":
                _, gid, token = item
                if token == self._token[gid]:
                    self.finished_version[gid] = self.group_version.pop(gid)
                    self.deliver(GroupFinished(gid, self.finished_version[gid]))
            else:
                event = item[1]
                if isinstance(event, SyncFinished):
                    self._finish_sync(event, item[2])
                self.deliver(event)
                if self.rng.random() < 0.3 and self.policy.rollout_only:
                    self._later(("event", ResourceIdle(self.rng.choice(self.policy.rollout_only))))
        raise AssertionError(f"not done after {max_events} events")

    def _finish_sync(self, event: SyncFinished, floor: int) -> None:
        for name in event.resources:
            self.weights[name] = event.version
        for gid, version in list(self.group_version.items()):
            if version < floor:
                self._start_group(gid)

    def deliver(self, event) -> None:
        for d in self.policy.on_event(event):
            getattr(self, f"_apply_{type(d).__name__}")(d)

    def _apply_Submit(self, d: Submit) -> None:
        assert d.num_groups >= 1
        self.submits.append(self.rollout_version())
        for _ in range(d.num_groups):
            self._start_group(self.next_gid)
            self.next_gid += 1

    def _apply_Refresh(self, d: Refresh) -> None:
        for gid in d.group_ids:
            assert gid in self.finished_version and gid not in self.trained
            self._start_group(gid)

    def _apply_StartTrain(self, d: StartTrain) -> None:
        assert all(self.policy.resources[r].can(TRAIN) for r in d.resources)
        assert len(set(d.group_ids)) == len(d.group_ids) == self.policy.config.batch_groups
        assert not set(d.group_ids) & set(self.trained), "a group trained twice"
        self.trained += d.group_ids
        self.steps.append(d.step)
        self.lags += [d.step - self.finished_version[g] for g in d.group_ids]
        self._later(("event", TrainFinished(d.step)))

    def _apply_SwitchTag(self, d: SwitchTag) -> None:
        assert self.policy.resources[d.resource].capabilities == {ROLLOUT, TRAIN}
        self._later(("event", SwitchFinished(d.resource, d.active)))

    def _apply_SyncWeights(self, d: SyncWeights) -> None:
        assert all(self.policy.resources[r].can(ROLLOUT) for r in d.resources)
        assert d.version == self.policy.version and d.min_keep_version <= d.version
        self._later(("event", SyncFinished(d.version, d.resources), d.min_keep_version))

    def _apply_Preempt(self, d: Preempt) -> None:
        assert self.policy.resources[d.resource].can(TRAIN)

    def _apply_PauseRollout(self, d: PauseRollout) -> None:
        assert set(d.resources) <= set(self.policy.rollout_only)

    def _apply_ResumeRollout(self, d: ResumeRollout) -> None:
        assert all(self.policy.resources[r].can(ROLLOUT) for r in d.resources)


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
    assert executor.lags and max(executor.lags) <= bound
    if name == "async":
        # batch j may only be generated with weights of version >= j - max_staleness
        assert all(j - version <= max_staleness for j, version in enumerate(executor.submits))
