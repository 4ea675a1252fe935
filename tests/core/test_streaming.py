"""`streaming`: the policy on its own (scripted decision logs, random completion orders through the
fake executor), then its runs in the simulator: the per-token staleness bound, device-seconds
conservation, partial rollout, determinism and the command line.
"""

from __future__ import annotations

import json
import math

import pytest

from core.errors import UserError
from core.events import (
    GroupFinished,
    Refresh,
    ResourceIdle,
    ResumeRollout,
    Started,
    StartTrain,
    Submit,
    SyncFinished,
    SyncWeights,
    TrainFinished,
)
from core.fake import FakeExecutor
from core.metrics import check_conservation, device_seconds_by_phase, summarize
from core.policies import PolicyConfig, make_policy
from sim.cli import main
from sim.config import CONFIG_DIR, load_config
from sim.report import write_run
from sim.runner import Simulation, simulate

R, T = ("R00",), ("T00",)


def check(policy, script: list[tuple]) -> None:
    assert [(event, policy.on_event(event)) for event, _ in script] == script


def lags(timeline) -> set[int]:
    return {lag for step in timeline.steps for lag, tokens in step.lag_tokens.items() if tokens}


# ---- the policy ----


def test_streaming_trains_as_batches_finish_and_pushes_weights_after_every_step():
    """A window of 1 + max_staleness = 2 batches counting the one training; the trainer takes the first
    groups to finish; each step pushes its weights (pausing the engines, then resuming every request);
    a finished group holding a token too old for the next step is regenerated; a step that ends while
    a push is still loading is followed by the newer weights as soon as it lands."""
    policy = make_policy("streaming", PolicyConfig(batch_groups=2, num_steps=4), 2, 0.5, 1)
    check(
        policy,
        [
            (Started(), [Submit(4)]),
            (GroupFinished(0, 0), []),
            (GroupFinished(2, 0), [StartTrain(0, (0, 2), T)]),  # not waiting for groups 1 and 3
            (GroupFinished(1, 0), []),  # the window is full while step 0 trains
            (TrainFinished(0), [SyncWeights(1, R, 0, 0), Submit(2)]),
            (SyncFinished(1, R, 0), [ResumeRollout(R)]),
            (GroupFinished(3, 0), [StartTrain(1, (1, 3), T)]),
            (GroupFinished(4, 0), []),  # started before version 1 landed: a token of version 0
            (TrainFinished(1), [SyncWeights(2, R, 1, 1), Refresh((4,), 1), Submit(2)]),  # too old for step 2
            (GroupFinished(5, 1), []),
            (GroupFinished(4, 1), [StartTrain(2, (5, 4), T)]),  # regenerated under version 1
            (TrainFinished(2), [Submit(2)]),  # version 2 still loading: version 3 follows it
            (SyncFinished(2, R, 1), [SyncWeights(3, R, 2, 2)]),  # the engines stay paused meanwhile
            (SyncFinished(3, R, 2), [ResumeRollout(R)]),
            (GroupFinished(6, 1), [Refresh((6,), 2)]),
            (ResourceIdle("R00"), []),  # the window is full: nothing more to start
            (GroupFinished(7, 2), []),
            (GroupFinished(8, 3), [StartTrain(3, (7, 8), T)]),
            (TrainFinished(3), []),  # the last step: no push
        ],
    )
    assert policy.done and policy.submitted == 10 and policy.consumed == 8 and policy.dropped == []


def test_drop_discards_a_stale_group_and_starts_a_new_one_in_its_place():
    policy = make_policy("streaming", PolicyConfig(batch_groups=2, num_steps=4, stale_samples="drop"), 2, 0.5, 1)
    check(
        policy,
        [
            (Started(), [Submit(4)]),
            (GroupFinished(0, 0), []),
            (GroupFinished(1, 0), [StartTrain(0, (0, 1), T)]),
            (GroupFinished(2, 0), []),
            (TrainFinished(0), [SyncWeights(1, R, 0, 0), Submit(2)]),
            (SyncFinished(1, R, 0), [ResumeRollout(R)]),
            (GroupFinished(3, 0), [StartTrain(1, (2, 3), T)]),
            (GroupFinished(4, 0), []),
            (TrainFinished(1), [SyncWeights(2, R, 1, 1), Submit(3)]),  # group 4 dropped, three new ones
        ],
    )
    assert policy.dropped == [4] and policy.in_flight == 4 and not policy.ready


def test_stale_samples_must_be_drop_or_regenerate():
    with pytest.raises(UserError, match=r"unknown policy.stale_samples 'keep'; valid choices: drop, regenerate"):
        PolicyConfig(batch_groups=1, num_steps=1, stale_samples="keep")


class RecordingFake(FakeExecutor):
    """The fake executor, also recording the most groups ever submitted and not yet trained."""

    most_outstanding = 0

    def submit(self, d) -> None:
        super().submit(d)
        outstanding = self.next_gid - len(self.trained)
        self.most_outstanding = max(self.most_outstanding, outstanding)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stale_samples", ["regenerate", "drop"])
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_any_completion_order_keeps_the_bound_and_the_window(max_staleness, stale_samples, seed):
    cfg = PolicyConfig(batch_groups=3, num_steps=8, max_staleness=max_staleness, stale_samples=stale_samples)
    policy = make_policy("streaming", cfg, num_resources=4, train_fraction=0.5, devices=2)
    executor = RecordingFake(policy, seed)
    executor.run()
    assert executor.steps == list(range(8))
    assert max(executor.lags) <= max_staleness
    assert not set(policy.dropped) & set(executor.trained)  # a dropped group is never trained
    # at most 1 + max_staleness batches in flight, finished or training (dropped ones are replaced)
    assert executor.most_outstanding - len(policy.dropped) <= 3 * (1 + max_staleness)


# ---- in the simulator ----


@pytest.mark.parametrize("stale_samples", ["regenerate", "drop"])
@pytest.mark.parametrize("kind", ["math", "swe"])
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_every_trained_token_is_within_the_bound(run_small, max_staleness, kind, stale_samples):
    timeline = run_small(
        "streaming", f"workload.kind={kind}", f"policy.max_staleness={max_staleness}",
        f"policy.stale_samples={stale_samples}", "num_steps=6",
    )  # fmt: skip
    assert max(lags(timeline)) == max_staleness  # the bound is used, never exceeded
    for step in timeline.steps:
        assert sum(step.lag_tokens.values()) == step.generated_tokens  # every trained token has a version
    generated = sum(iv.tokens for iv in timeline.intervals if iv.phase.value == "rollout")
    trained = sum(s.generated_tokens for s in timeline.steps)
    assert generated >= trained + timeline.counters.get("wasted_tokens", 0)


def test_zero_staleness_trains_only_fresh_tokens(run_small):
    assert lags(run_small("streaming", "policy.max_staleness=0")) == {0}


@pytest.mark.parametrize("overrides", [(), ("policy.stale_samples=drop",), ("workload.kind=swe",)])
def test_device_seconds_are_conserved(run_small, overrides):
    timeline = run_small("streaming", *overrides)
    check_conservation(timeline)
    wall, devices = timeline.wall_s, {iv.resource: iv.devices for iv in timeline.intervals}
    assert math.fsum(device_seconds_by_phase(timeline).values()) == pytest.approx(32 * wall, rel=1e-12)
    for name in devices:  # each resource on its own: its intervals tile [0, wall_s]
        own = math.fsum(iv.end_s - iv.start_s for iv in timeline.intervals if iv.resource == name)
        assert own == pytest.approx(wall, rel=1e-12), name
    assert sum(devices.values()) == 32


def test_weights_are_pushed_after_every_step_and_no_resource_switches_roles(run_small):
    summary = summarize(run_small("streaming", "num_steps=6"))
    assert summary["sync_time_s"]["count"] >= 5  # after every step but the last (a late push may chain)
    assert summary["utilisation"]["switch"] == 0.0


class Recording(Simulation):
    """The simulator, also keeping the per-token versions of every trained sample."""

    def start_train(self, d) -> None:
        self.trained_versions = getattr(self, "trained_versions", [])
        self.trained_versions += [dict(s.version_tokens) for gid in d.group_ids for s in self.groups[gid]]
        super().start_train(d)


def test_partial_rollout_trains_samples_whose_tokens_carry_several_versions(small_config):
    sim = Recording.from_config(small_config("num_steps=4"), "streaming")
    sim.run()
    assert any(len(versions) >= 2 for versions in sim.trained_versions)


def test_drop_counts_the_dropped_groups_tokens_as_wasted(run_small):
    """With a small train pool, groups that finish while a push is pending go stale before the trainer
    reaches them: `drop` discards them whole, `regenerate` restarts their stale samples."""
    dropped = run_small("streaming", "policy.stale_samples=drop", "pools.train_fraction=0.25", "num_steps=6")
    regenerated = run_small("streaming", "pools.train_fraction=0.25", "num_steps=6")
    assert dropped.counters["dropped_groups"] > 0
    assert "dropped_groups" not in regenerated.counters
    assert dropped.counters["restarted_requests"] < regenerated.counters["restarted_requests"]
    trained = sum(s.generated_tokens for s in dropped.steps)
    generated = sum(iv.tokens for iv in dropped.intervals if iv.phase.value == "rollout")
    assert generated >= trained + dropped.counters["wasted_tokens"]


@pytest.mark.parametrize("kind", ["math", "swe"])
def test_same_seed_gives_byte_identical_outputs(small_config, tmp_path, kind):
    cfg = small_config(f"workload.kind={kind}", "num_steps=3")
    for folder in ("a", "b"):
        write_run(simulate(cfg, "streaming"), cfg, tmp_path / folder, picture=False)
    for name in ("summary.json", "intervals.json", "timeline.json", "config.yaml"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_the_command_line_runs_streaming(capsys, tmp_path):
    small = ["cluster.num_gpus=32", "workload.prompts_per_step=16", "model=qwen3-8b", "rollout.tensor_parallel=2"]
    argv = ["--policy", "streaming", "--out", str(tmp_path / "run"), "--quiet", "--no-picture", "--set", "num_steps=2"]
    assert main([*argv, *(arg for key in small for arg in ("--set", key))]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["policy"] == "streaming" and summary["num_steps"] == 2
    assert "streaming" in capsys.readouterr().out


def test_the_long_reasoning_config_has_long_tailed_answers():
    """sim/configs/long_reasoning.yaml: R1-style answers, mean near 11k tokens with a tail to the cap."""
    cfg = load_config(CONFIG_DIR / "long_reasoning.yaml", ["num_steps=1"])
    timeline = simulate(cfg, "streaming")
    mean = summarize(timeline)["trained_response_tokens_mean"]
    assert 8_000 <= mean <= 16_000
    assert cfg.workload.response_tokens.max >= 3 * cfg.workload.response_tokens.median
