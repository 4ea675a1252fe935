"""SWE tasks through the runtime's group rollout (the episode seam): `swebench_env.training.SweTask`.

The manager's engine plays the shipped demonstrations of some tasks (`scripted.demonstration_engine`); for
a task it has no demonstration of it answers without a tool call, so that episode ends at the turn limit
unresolved. Groups of episodes then come out rewarded 1 and 0, with one record an episode for the trainer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from types import SimpleNamespace

import pytest

from core.errors import UserError
from core.tags import SandboxPhase
from core.timeline import TimelineRecorder
from reference.control.executor import RuntimeExecutor
from reference.rollout.episodes import SANDBOX_SPANS, Episode, episode_records
from reference.rollout.groups import GroupResult, RolloutConfig, RolloutManager, training_batch
from reference.tasks import make_task
from reference.tasks.base import Problem
from reference.tokenizer import default_tokenizer
from swebench_env.scripted import demonstration_manager
from swebench_env.suite import load_suite, load_suite_demonstrations


@pytest.fixture(scope="module")
def pairs():
    return list(zip(load_suite("train"), load_suite_demonstrations("train"), strict=True))


async def _groups(task, url: str, problems, group_size: int) -> list:
    done: list = []
    config = RolloutConfig(group_size=group_size, max_concurrency=8)
    async with RolloutManager(task, url, config, "swe", 0, done.append) as rollout:
        rollout.submit(len(problems), problems)
        while len(done) < len(problems) and rollout.failure is None:
            await asyncio.sleep(0.05)
        if rollout.failure is not None:
            raise rollout.failure
    return sorted(done, key=lambda g: g.group_id)


def _train(task, pairs, tmp_path, group_size: int = 2):
    """A group of the task the engine has a demonstration of, then one of a task it has none of."""
    by_id = {p.problem_id: p for p in task.train_problems()}
    problems = [by_id[pairs[0][0].instance_id], by_id[pairs[1][0].instance_id]]
    with demonstration_manager(pairs[:1], store=tmp_path / "t.sqlite") as m:
        groups = asyncio.run(asyncio.wait_for(_groups(task, m.url, problems, group_size), timeout=600))
        batch = training_batch(m.store, groups)
        records = episode_records(m.store, [e for g in groups for e in g.episodes])
    return groups, batch, records


def _check(groups, batch, records, pairs) -> None:
    solved, unsolved = groups
    assert solved.problem.problem_id == pairs[0][0].instance_id
    assert [e.reward for e in solved.episodes] == [1.0, 1.0]
    assert [e.exit_reason for e in solved.episodes] == ["submitted", "submitted"]
    assert [e.reward for e in unsolved.episodes] == [0.0, 0.0]
    assert [e.exit_reason for e in unsolved.episodes] == ["turn_limit", "turn_limit"]
    assert len(batch) == 4  # the built-in agent only appends: one record an episode, all its turns in it
    assert [t.episode_id for t in batch] == [0, 1, 0, 1]
    assert [t.trained for t in batch] == [True, True, False, False]  # cut off at the turn limit: masked (overlong)
    steps = len(pairs[0][1].steps)
    for episode, (record,) in zip(solved.episodes, records, strict=False):
        assert len(episode.request_ids) == steps
        assert sum(record["generated_mask"]) == episode.tokens
    tok = default_tokenizer()
    record = records[0][0]
    generated = tok.decode([t for t, g in zip(record["token_ids"], record["generated_mask"], strict=True) if g])
    context = tok.decode([t for t, g in zip(record["token_ids"], record["generated_mask"], strict=True) if not g])
    assert "exit code" in context  # the observations are context ...
    assert "exit code" not in generated  # ... never trained on
    assert "<tool_call>" in generated


def test_swe_groups_in_local_checkouts(pairs, tmp_path):
    task = make_task("swe", sandbox="local", max_turns=9, concurrency=2)
    try:
        _check(*_train(task, pairs, tmp_path), pairs)
    finally:
        task.close()


def test_the_demonstrations_become_warm_start_records_through_a_manager_that_sheds_nothing(tmp_path, monkeypatch):
    """Every train task's demonstration replayed at once (`concurrency` of them) through a manager that sheds
    nothing (its default sheds with 429 while its event loop lags, as when 32 agents start together): each is
    one record of generated replies and observed context."""
    import swebench_env.scripted
    from swebench_env.tasks import dump_tasks

    configs = []
    original = swebench_env.scripted.demonstration_manager

    def spy(pairs, tokenizer=None, store=":memory:", config=None, **kwargs):
        configs.append(config)
        return original(pairs, tokenizer, store, config, **kwargs)

    monkeypatch.setattr(swebench_env.scripted, "demonstration_manager", spy)
    train = dump_tasks(load_suite("train")[:4], tmp_path / "train.jsonl")
    task = make_task("swe", sandbox="local", concurrency=4, train_tasks=str(train))
    try:
        records = task.demonstrations(tmp_path / "demos")
    finally:
        task.close()
    assert [(c.max_in_flight_requests, c.max_loop_lag_s) for c in configs] == [(0, 0)]
    assert len(records) == 4 and all(r.num_generated > 0 and r.trained for r in records)
    assert (tmp_path / "demos" / "demonstrations.sqlite").is_file()


@pytest.mark.docker
def test_swe_groups_in_docker_sandboxes(pairs, tmp_path):
    task = make_task("swe", sandbox="docker", max_turns=9, concurrency=2)
    try:
        groups, batch, records = _train(task, pairs, tmp_path)
    finally:
        task.close()
    _check(groups, batch, records, pairs)
    for episode in [e for g in groups for e in g.episodes]:
        spans = episode.info[SANDBOX_SPANS]
        kinds = [kind for _, kind, _, _ in spans]
        assert kinds.count("test_run") == 1  # graded once, in a container of its own
        assert kinds.count("tool") >= 1  # its commands, and the final diff at least
        assert all(start <= end for _, _, start, end in spans)
        assert 0.0 <= episode.info["sandbox_wait_s"] < episode.info["episode_s"]
        for lane in {lane for lane, _, _, _ in spans}:  # one container at a time on a lane: no overlap
            on_lane = sorted((start, end) for name, _, start, end in spans if name == lane)
            assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(on_lane))


def test_sandbox_spans_of_finished_groups_reach_the_timeline_in_the_runs_time_base(tmp_path):
    """The runtime executor puts each finished group's sandbox spans (unix seconds) on the timeline's lanes, in
    seconds since the run started, once each (a refreshed group announces its kept episodes again)."""
    announced: list = []
    rollout = SimpleNamespace(on_group=announced.append)
    recorder = TimelineRecorder([], {})
    executor = RuntimeExecutor(None, rollout, None, recorder, ["T0"], tmp_path, None)
    executor.attach(lambda event: None)
    t0 = time.time() - executor.now()
    spans = [("sandbox-1", "start", t0 - 5.0, t0 + 0.5), ("sandbox-1", "tool", t0 + 0.5, t0 + 0.75),
             ("sandbox-1", "nonsense", t0 + 0.75, t0 + 0.8), ("sandbox-0", "test_run", t0 + 0.8, t0 + 60)]  # fmt: skip
    episode = Episode("s-e0", ("r0",), 1.0, True, 0, 0, 3, info={SANDBOX_SPANS: spans})
    group = GroupResult(0, "s", Problem("p", "", ""), (episode,))
    rollout.on_group(group)
    rollout.on_group(group)
    assert announced == [group, group]  # still announced, after the spans are recorded
    timeline = recorder.finish(5.0, {}, {})  # the run ended 5 s after it started
    got = [(sb.lane, sb.phase, round(sb.start_s, 2), sb.session) for sb in timeline.sandboxes]
    assert got == [("sandbox-0", SandboxPhase.TEST_RUN, 0.8, "s-e0"), ("sandbox-1", SandboxPhase.START, 0.0, "s-e0"),
                   ("sandbox-1", SandboxPhase.TOOL, 0.5, "s-e0")]  # fmt: skip
    assert timeline.sandboxes[0].end_s == 5.0  # clipped to the run
    assert timeline.sandboxes[1].end_s == pytest.approx(0.5, abs=1e-3)


def test_training_tasks_come_in_shuffled_passes_over_the_split():
    task = make_task("swe", sandbox="local")
    split = sorted(p.problem_id for p in task.train_problems())
    drawn = [p.problem_id for p in task.sample_train(random.Random(3), 5 * len(split) // 2)]
    passes = [drawn[i : i + len(split)] for i in range(0, len(drawn), len(split))]
    assert sorted(passes[0]) == sorted(passes[1]) == split  # each task once a pass
    assert passes[0] != passes[1] and passes[0] != split  # each pass in its own shuffled order
    assert len(set(passes[2])) == len(passes[2])  # a pass cut short repeats nothing either
    again = make_task("swe", sandbox="local")  # the same seed, the same order, over calls of any size
    rng = random.Random(3)
    assert [p.problem_id for n in (7, 1, 40, 32) for p in again.sample_train(rng, n)] == drawn


def test_bad_task_settings_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(UserError, match="unknown agent 'nope'"):
        make_task("swe", agent="nope")
    with pytest.raises(UserError, match="max_turns must be an integer >= 1, got 0"):
        make_task("swe", max_turns=0)
    with pytest.raises(UserError, match="unknown overlong 'drop'"):
        make_task("swe", overlong="drop")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instance_id": "x"}\n')
    with pytest.raises(UserError, match="no usable task"):
        make_task("swe", train_tasks=str(broken), sandbox="local")
    assert "warning: " in capsys.readouterr().err
    good = load_suite("train")[0]
    mixed = tmp_path / "mixed.jsonl"
    line = json.dumps(good.to_dict(relative_to=tmp_path))
    mixed.write_text(f'{line}\n{{"instance_id": "x"}}\n')
    task = make_task("swe", train_tasks=str(mixed), sandbox="local")
    assert [p.problem_id for p in task.train_problems()] == [good.instance_id]
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("warning: ") and "line 2" in warning and warning.endswith("(skipped)")


def _agent_containers(client) -> list:
    import os

    labels = ["seamlessflow.role=agent", f"seamlessflow.owner_pid={os.getpid()}"]
    return client.containers.list(filters={"label": labels}, ignore_removed=True)


@pytest.mark.docker
def test_a_sandbox_killed_mid_episode_fails_that_episode_alone(pairs, tmp_path, daemon):
    """Two episodes of a task the engine has a demonstration of; once the first sandbox exists and its episode
    has made a model call, the container is killed (a leased one: not a spare). That episode ends without a
    verdict (dropped) or with reward 0; the other resolves; no container is left."""
    import threading
    import time

    task = make_task("swe", sandbox="docker", max_turns=9, concurrency=2)
    (problem,) = [p for p in task.train_problems() if p.problem_id == pairs[0][0].instance_id]
    killed: list[str] = []
    with demonstration_manager(pairs[:1], store=tmp_path / "t.sqlite") as m:

        def kill_one() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                started = any(m.store.has_session(f"swe-g0-e{i}") for i in (0, 1))  # a model call was made
                pool = task.sandbox_pool
                leased = set(pool.names()["leased"]) if pool is not None else set()
                containers = [c for c in _agent_containers(daemon) if c.name in leased]
                if started and containers:
                    containers[0].kill()
                    killed.append(containers[0].name)
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_one)
        killer.start()
        try:
            groups = asyncio.run(asyncio.wait_for(_groups(task, m.url, [problem], 2), timeout=600))
        finally:
            killer.join()
            task.close()
    assert killed
    (group,) = groups
    assert [e.reward for e in group.episodes].count(1.0) == 1  # the other episode resolves
    assert len(group.episodes) in (1, 2)  # the killed one: dropped (no verdict) or kept with reward 0
    assert all(e.reward in (0.0, 1.0) for e in group.episodes)
    assert _agent_containers(daemon) == []


def test_a_grader_that_times_out_gives_reward_zero_and_the_run_goes_on(pairs, tmp_path):
    """Tests that cannot finish within test_timeout_s: the episode is graded unresolved (a timeout is a verdict on
    the patch: the tests did not pass), the group still finishes."""
    task = make_task("swe", sandbox="local", max_turns=9, concurrency=2, test_timeout_s=0.001)
    (problem,) = [p for p in task.train_problems() if p.problem_id == pairs[0][0].instance_id]
    try:
        with demonstration_manager(pairs[:1], store=tmp_path / "t.sqlite") as m:
            (group,) = asyncio.run(asyncio.wait_for(_groups(task, m.url, [problem], 2), timeout=600))
    finally:
        task.close()
    assert [e.reward for e in group.episodes] == [0.0, 0.0]
    assert [e.exit_reason for e in group.episodes] == ["submitted", "submitted"]
