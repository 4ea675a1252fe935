"""Tests for core.driver: dispatch, the contract checks, phases on the timeline, lost resources,
deadlines, and the two real-time ways to feed it (threads and asyncio).

Scripted tests use a policy that answers each event with a fixed list of decisions and an executor
that logs its calls on a clock the test sets; whole runs use the seeded fake of `core.fake`.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import typing

import pytest

from core.driver import Deadlines, Driver
from core.errors import ContractError, DecisionTimeout, RunFailed
from core.events import (
    Decision,
    Event,
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
    awaits,
    completes,
)
from core.fake import FakeExecutor
from core.policies import POLICIES, PolicyConfig, make_policy
from core.tags import Phase, Resource, Tag
from core.timeline import TimelineRecorder

ROLLOUT, TRAIN = Tag.ROLLOUT, Tag.TRAIN
RESOURCES = [Resource(f"R0{i}", frozenset({ROLLOUT}), 1) for i in range(2)] + [
    Resource(f"T0{i}", frozenset({ROLLOUT, TRAIN}), 2) for i in range(3)
]
ACTIVE = {r.name: "rollout" for r in RESOURCES}

# One decision of each type, each with the event that completes it (None: fire-and-forget).
SAMPLES: list[tuple[Decision, Event | None]] = [
    (Submit(2), None),
    (Preempt("T00"), PreemptFinished("T00")),
    (SwitchTag("T01", TRAIN), SwitchFinished("T01", TRAIN)),
    (StartTrain(0, (0, 1), ("T02",)), TrainFinished(0)),
    (Refresh((1,), 0), None),
    (SyncWeights(1, ("R00",), 0, 7), SyncFinished(1, ("R00",), 7)),
    (ResumeRollout(("R01",)), None),
]
METHODS = ["submit", "preempt", "switch_tag", "start_train", "refresh", "sync_weights", "resume_rollout"]


class ScriptedPolicy:
    """Answers each event with the decisions `replies` lists for it (none by default)."""

    name = "scripted"

    def __init__(self, replies: dict[Event, list[Decision]] | None = None) -> None:
        self.replies = replies or {}
        self.resources = {r.name: r for r in RESOURCES}
        self.rollout_only, self.trainers = ("R00", "R01"), ("T00", "T01", "T02")
        self.step = self.version = self.in_flight = 0
        self.seen: list[Event] = []
        self.done = False

    def on_event(self, event: Event) -> list[Decision]:
        self.seen.append(event)
        return list(self.replies.get(event, []))

    def initial_active(self, resource: str) -> Tag:
        return ROLLOUT


class LogExecutor:
    """Logs each call as (method, decision); `hooks[method]` runs inside the call."""

    def __init__(self) -> None:
        self.t = 0.0
        self.calls: list[tuple[str, Decision]] = []
        self.hooks: dict[str, typing.Callable[[Decision], None]] = {}

    def now(self) -> float:
        return self.t

    def __getattr__(self, method: str):
        if method not in METHODS:
            raise AttributeError(method)

        def call(decision: Decision) -> None:
            self.calls.append((method, decision))
            if method in self.hooks:
                self.hooks[method](decision)

        return call


def make(replies=None, recorder=None, deadlines=None) -> tuple[ScriptedPolicy, LogExecutor, Driver]:
    policy, executor = ScriptedPolicy(replies), LogExecutor()
    return policy, executor, Driver(policy, executor, recorder, deadlines or Deadlines.none())


def feed(driver: Driver, *events: Event) -> None:
    for event in events:
        driver.post(event)
    driver.drain()


# ---- dispatch ----


def test_every_decision_type_goes_to_its_own_method_in_the_order_returned():
    decisions = [d for d, _ in SAMPLES]
    assert {type(d) for d in decisions} == set(typing.get_args(Decision))  # one sample per type
    policy, executor, driver = make({Started(): decisions})
    driver.start()
    driver.drain()
    assert executor.calls == list(zip(METHODS, decisions, strict=True))
    assert policy.seen == [Started()]


def test_awaited_decisions_pair_with_their_completion_and_have_deadlines():
    for decision, event in SAMPLES:
        if event is None:
            assert awaits(decision) is None and Deadlines().limit(decision) is None
        else:
            assert awaits(decision) == completes(event) is not None
            assert Deadlines().limit(decision) > 0
    for event in (Started(), GroupFinished(0, 0), ResourceIdle("R00"), ResourceLost("R00")):
        assert completes(event) is None


def test_events_raised_while_applying_a_list_reach_the_policy_after_it():
    policy, executor, driver = make({Started(): [Preempt("T00"), Submit(1)]})
    executor.hooks["preempt"] = lambda d: (driver.post(PreemptFinished(d.resource)), driver.drain())
    driver.start()
    driver.drain()
    assert [m for m, _ in executor.calls] == ["preempt", "submit"]
    assert policy.seen == [Started(), PreemptFinished("T00")]
    assert driver.outstanding == []


# ---- the control-plane phases on the timeline ----


def test_switch_and_sync_intervals_open_at_dispatch_and_close_when_the_completion_is_posted():
    recorder = TimelineRecorder(RESOURCES, ACTIVE)
    sync = SyncWeights(1, ("R00",), 0, 0)
    policy, executor, driver = make(
        {Started(): [SwitchTag("T00", TRAIN)], SwitchFinished("T00", TRAIN): [sync]}, recorder
    )
    executor.t = 1.0
    feed(driver, Started())
    executor.t = 3.0
    feed(driver, SwitchFinished("T00", TRAIN))
    executor.t = 4.5
    feed(driver, SyncFinished(1, ("R00",), 0))
    timeline = recorder.finish(5.0, {}, {})
    rows = [(iv.resource, iv.phase.value, iv.active, iv.start_s, iv.end_s, iv.step) for iv in timeline.intervals]
    assert [row for row in rows if row[0] in ("R00", "T00")] == [
        ("R00", "idle", "rollout", 0.0, 3.0, 0),
        ("R00", "sync", "rollout", 3.0, 4.5, 1),
        ("R00", "idle", "rollout", 4.5, 5.0, 1),
        ("T00", "idle", "rollout", 0.0, 1.0, 0),
        ("T00", "switch", "train", 1.0, 3.0, 0),
        ("T00", "idle", "train", 3.0, 5.0, 0),
    ]


def test_a_decision_completed_before_its_method_returned_leaves_no_interval():
    recorder = TimelineRecorder(RESOURCES, ACTIVE)
    policy, executor, driver = make({Started(): [SwitchTag("T00", TRAIN)]}, recorder)
    executor.hooks["switch_tag"] = lambda d: driver.post(SwitchFinished(d.resource, d.active))
    executor.t = 1.0
    feed(driver, Started())
    assert policy.seen == [Started(), SwitchFinished("T00", TRAIN)]
    assert {iv.phase for iv in recorder.finish(2.0, {}, {}).intervals} == {Phase.IDLE}


# ---- contract checks ----


def test_a_completion_of_no_outstanding_decision_is_refused():
    policy, executor, driver = make({Started(): [SwitchTag("T00", TRAIN)]})
    with pytest.raises(ContractError, match=r"TrainFinished\(step=3\) completes no outstanding decision"):
        feed(driver, TrainFinished(3))
    feed(driver, Started())
    message = "SwitchFinished(resource='T00', active=Tag.ROLLOUT) completes no outstanding decision (outstanding: "
    with pytest.raises(ContractError, match=re.escape(message + "SwitchTag(resource='T00', active=Tag.TRAIN))")):
        feed(driver, SwitchFinished("T00", ROLLOUT))


@pytest.mark.parametrize(
    ("decisions", "message"),
    [
        (
            [SwitchTag("T00", TRAIN), ResumeRollout(("R00", "T00"))],
            "ResumeRollout(resources=('R00', 'T00')) names 'T00', which is still busy with "
            "SwitchTag(resource='T00', active=Tag.TRAIN)",
        ),
        (
            [Preempt("X00")],
            "Preempt(resource='X00') names unknown resource 'X00' (known: ['R00', 'R01', 'T00', 'T01', ",
        ),
    ],
)
def test_a_decision_on_a_busy_or_unknown_resource_is_refused(decisions, message):
    _, _, driver = make({Started(): decisions})
    with pytest.raises(ContractError, match=re.escape(message)):
        feed(driver, Started())


def test_drain_belongs_to_one_thread():
    _, _, driver = make()
    feed(driver, Started())
    errors: list[BaseException] = []

    def other() -> None:
        try:
            driver.drain()
        except ContractError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert "drain on one control thread only" in str(errors[0])


# ---- lost resources ----


def test_a_loss_abandons_the_decisions_on_the_resource_and_drops_their_late_events():
    recorder = TimelineRecorder(RESOURCES, ACTIVE)
    sync = SyncWeights(1, ("R00", "T00"), 0, 4)
    policy, executor, driver = make({Started(): [sync]}, recorder)
    feed(driver, Started())
    assert driver.outstanding == [sync]
    executor.t = 2.0
    feed(driver, ResourceLost("R00"))
    assert driver.outstanding == [] and driver.lost == ("R00",)
    executor.t = 3.0
    feed(driver, SyncFinished(1, ("R00", "T00"), 4), ResourceIdle("R00"), ResourceLost("R00"))
    assert policy.seen == [Started(), ResourceLost("R00")]  # the late completion, the idle and the repeat: dropped
    rows = [(iv.resource, iv.phase.value, iv.start_s, iv.end_s) for iv in recorder.finish(4.0, {}, {}).intervals]
    assert ("R00", "sync", 0.0, 2.0) in rows and ("R00", "idle", 2.0, 4.0) in rows


def test_decisions_made_before_the_policy_saw_a_loss_spare_the_lost_resource():
    """In real time a loss can be posted while the policy still decides with the old pools."""
    sync, resume = SyncWeights(1, ("R00", "R01"), 0, 0), ResumeRollout(("R00", "R01"))
    policy, executor, driver = make({GroupFinished(0, 0): [sync, resume, Submit(1)]})
    executor.hooks["submit"] = lambda d: driver.post(SyncFinished(1, ("R00", "R01"), 0))  # a stray completion
    driver.post(GroupFinished(0, 0))
    driver.post(ResourceLost("R01"))
    driver.drain()
    assert executor.calls == [("resume_rollout", ResumeRollout(("R00",))), ("submit", Submit(1))]
    assert policy.seen == [GroupFinished(0, 0), ResourceLost("R01")]  # the abandoned sync's completion: dropped
    assert driver.outstanding == []


def test_a_decision_on_a_lost_resource_is_refused():
    _, _, driver = make({ResourceLost("R00"): [ResumeRollout(("R00",))]})
    with pytest.raises(ContractError, match=re.escape("ResumeRollout(resources=('R00',)) names lost resource 'R00'")):
        feed(driver, ResourceLost("R00"))


def test_losing_every_train_resource_fails_the_run_naming_them():
    policy = make_policy("tag", PolicyConfig(batch_groups=2, num_steps=4), 4, 0.5, 1)
    executor = FakeExecutor(policy, seed=1)
    executor.lose("T00", at_s=3.0)
    executor.lose("T01", at_s=6.0)
    with pytest.raises(RunFailed, match=re.escape("policy 'tag' has no train-capable resource left (lost: T00, T01)")):
        executor.run()


# ---- deadlines ----


@pytest.mark.parametrize(
    ("name", "silent", "message"),
    [
        ("colocated", SwitchTag, r"SwitchTag\(resource='C00', active=Tag.TRAIN\) did not finish within 600 s"),
        ("tag", Preempt, r"Preempt\(resource='T00'\) did not finish within 300 s"),
        (
            "disaggregated",
            SyncWeights,
            r"SyncWeights\(version=1, resources=\('R00', 'R01'\), min_keep_version=1, sync_id=0\) "
            r"did not finish within 600 s",
        ),
        (
            "async",
            StartTrain,
            r"StartTrain\(step=0, group_ids=\(\d+, \d+, \d+\), resources=\('T00', 'T01'\)\) "
            r"did not finish within 3600 s",
        ),
    ],
)
def test_a_decision_that_never_finishes_fails_the_run_at_its_deadline(name, silent, message):
    policy = make_policy(name, PolicyConfig(batch_groups=3, num_steps=4), 4, 0.5, 1)
    executor = FakeExecutor(policy, seed=2, deadlines=Deadlines())
    executor.silent.add(silent)
    with pytest.raises(DecisionTimeout, match=message) as caught:
        executor.run()
    started, now = map(float, re.search(r"started at ([\d.]+) s, now ([\d.]+) s", str(caught.value)).groups())
    assert now - started >= Deadlines().limit(executor.driver.outstanding[0])


def test_deadlines_must_be_positive():
    with pytest.raises(ValueError, match=r"deadline sync_s must be a positive number of seconds or None, got 0"):
        Deadlines(sync_s=0)
    with pytest.raises(ValueError, match=r"deadline train_s .* got inf"):
        Deadlines(train_s=float("inf"))
    assert all(Deadlines.none().limit(d) is None for d, _ in SAMPLES)


# ---- real time ----


@pytest.mark.parametrize("name", list(POLICIES))
def test_threads_feed_the_blocking_loop_and_every_policy_finishes(name):
    policy = make_policy(name, PolicyConfig(batch_groups=3, num_steps=5), 4, 0.5, 1)
    executor = FakeExecutor(policy, seed=3, deadlines=Deadlines(switch_s=5, sync_s=5, preempt_s=5, train_s=5))
    executor.lose(policy.trainers[0], at_s=4.0)
    executor.run_threaded(second_s=0.001, timeout_s=30)
    assert executor.steps == list(range(5))
    assert max(executor.lags) <= (0 if policy.strictly_on_policy else 1)


@pytest.mark.parametrize("name", list(POLICIES))
def test_asyncio_feeds_the_async_loop_and_every_policy_finishes(name):
    policy = make_policy(name, PolicyConfig(batch_groups=3, num_steps=5), 4, 0.5, 1)
    executor = FakeExecutor(policy, seed=4)
    asyncio.run(executor.run_asyncio(second_s=0.001, timeout_s=30))
    assert executor.steps == list(range(5))
    assert max(executor.lags) <= (0 if policy.strictly_on_policy else 1)


def test_a_silent_sync_times_out_in_real_time():
    policy = make_policy("disaggregated", PolicyConfig(batch_groups=2, num_steps=3), 4, 0.5, 1)
    executor = FakeExecutor(policy, seed=5, deadlines=Deadlines(sync_s=0.05))
    executor.silent.add(SyncWeights)
    start = time.monotonic()
    with pytest.raises(DecisionTimeout, match=r"SyncWeights\(version=1, .*\) did not finish within 0.05 s"):
        executor.run_threaded(second_s=0.001, timeout_s=30)
    assert time.monotonic() - start < 10


def test_run_gives_up_after_its_timeout_naming_what_is_outstanding():
    policy = ScriptedPolicy({Started(): [SwitchTag("T00", TRAIN)]})
    executor = LogExecutor()
    t0 = time.monotonic()
    executor.now = lambda: time.monotonic() - t0
    driver = Driver(policy, executor, deadlines=Deadlines.none())
    message = "run did not finish within 0.05 s: step 0, 0 groups in flight, outstanding decisions: SwitchTag("
    with pytest.raises(RunFailed, match=re.escape(message)):
        driver.run(timeout_s=0.05)
