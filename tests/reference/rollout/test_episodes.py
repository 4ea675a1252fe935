"""The episode seam: multi-turn episodes through the real manager, trained once each.

A scripted chat agent (`reference.rollout.fake.ChatEpisodesTask`) talks to a trajectory manager over a
deterministic fake engine with the official OpenAI client; with `rewrite_at` it drops an old observation
from its history, so its session splits into two branches.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from reference.engine.fake import FakeEngine
from reference.manager.embedded import ManagerThread
from reference.rollout.episodes import Episode, episode_records
from reference.rollout.fake import ChatEpisodesConfig, ChatEpisodesTask, naive_branch_records
from reference.rollout.groups import RolloutConfig, RolloutError, RolloutManager, training_batch, untrained_groups
from reference.tasks.math import MathTask
from reference.trainer.advantages import group_advantages


async def _groups(task, url: str, num_groups: int, group_size: int = 2, retries: int = 1) -> tuple[list, dict]:
    done: list = []
    config = RolloutConfig(group_size=group_size, max_concurrency=8, retries=retries)
    async with RolloutManager(task, url, config, "ep", 0, done.append) as rollout:
        rollout.submit(num_groups)
        while len(done) < num_groups and rollout.failure is None:
            await asyncio.sleep(0.01)
        if rollout.failure is not None:
            raise rollout.failure
        return done, {"requests": rollout.requests, "dropped": rollout.dropped}


def _run(task, m: ManagerThread, num_groups: int, **kw):
    return asyncio.run(asyncio.wait_for(_groups(task, m.url, num_groups, **kw), timeout=120))


def _generated_positions(records: list[dict]) -> list[tuple[str, int]]:
    """(request id, index of the token in that request's reply) of every position a record trains."""
    out = []
    for r in records:
        for i, g in enumerate(r["generated_mask"]):
            if g:
                out.append((r["token_ids"][i], r["versions"][i], r["logprobs"][i]))
    return out


@pytest.fixture
def manager(tok, tmp_path):
    engine = FakeEngine(vocab_size=tok.vocab_size, reply_tokens=6, stop_token_id=tok.im_end_id)
    with ManagerThread({"fake-0": engine}, tok, tmp_path / "t.sqlite") as m:
        yield m


def test_an_appending_agent_gives_one_record_holding_every_turn(manager):
    task = ChatEpisodesTask(turns=3)
    (group,), _ = _run(task, manager, 1)
    (episode, _) = group.episodes
    (records,) = episode_records(manager.manager.store, [episode])
    (record,) = records
    store_records = {r.request_id: r for r in manager.manager.store.records(episode.session_id)}
    replies = [store_records[rid].token_ids for rid in episode.request_ids]
    assert sum(record["generated_mask"]) == sum(len(r) for r in replies) == episode.tokens
    assert record["token_ids"][-len(replies[-1]) :] == list(replies[-1])
    assert record["reward"] == 1.0


def test_a_history_rewriting_episode_trains_each_sampled_token_once(manager):
    """Turn 3 drops the oldest observation: two branches. Exporting both branches trains turn 1's reply twice;
    the episode's records train every request's reply exactly once, observations and prompts masked."""
    task = ChatEpisodesTask(turns=4, rewrite_at=3)
    (group,), _ = _run(task, manager, 1)
    store = manager.manager.store
    episode = group.episodes[0]
    (records,) = episode_records(store, [episode])
    assert len(records) == 2  # one per version of the history
    by_id = {r.request_id: r for r in store.records(episode.session_id)}
    sampled = sorted((t, v, lp) for rid in episode.request_ids for t, lp, v in
                     zip(by_id[rid].token_ids, by_id[rid].logprobs, by_id[rid].versions, strict=True))  # fmt: skip
    assert sorted(_generated_positions(records)) == sampled
    # The naive export of the session's branches trains the shared first reply in both branches.
    naive = naive_branch_records(store, [episode.session_id])
    assert len(naive) == 2
    assert sum(sum(r["generated_mask"]) for r in naive) > len(sampled)
    # Every trained token is at a position where the engine sampled it, never in the observations.
    tokenizer = task.tokenizer
    for r in records:
        text = tokenizer.decode([t for t, g in zip(r["token_ids"], r["generated_mask"], strict=True) if g])
        assert "observation" not in text


def test_the_group_counts_each_episode_once_in_its_advantages(manager):
    """Episode 0 (reward 1) rewrites its history and comes as two records, episode 1 (reward 0) as two as well;
    the group mean is 0.5 over episodes, so every record of episode 0 gets +0.5 and of episode 1 -0.5."""
    task = ChatEpisodesTask(turns=3, rewrite_at=3, rewards=(1.0, 0.0))
    (group,), _ = _run(task, manager, 1)
    batch = training_batch(manager.manager.store, [group])
    assert [t.episode_id for t in batch] == [0, 0, 1, 1]
    advantages = group_advantages([t.reward for t in batch], [t.group_id for t in batch], normalize_std=False,
                                  episode_ids=[t.episode_id for t in batch])  # fmt: skip
    assert advantages == [0.5, 0.5, -0.5, -0.5]


def test_advantages_count_episodes_not_records():
    rewards, groups = [1.0, 1.0, 1.0, 0.0], ["g"] * 4
    per_record = group_advantages(rewards, groups, normalize_std=False)
    per_episode = group_advantages(rewards, groups, normalize_std=False, episode_ids=[0, 0, 0, 1])
    assert per_record == [0.25, 0.25, 0.25, -0.75]
    assert per_episode == [0.5, 0.5, 0.5, -0.5]
    with pytest.raises(ValueError, match="rewards 1.0 and 0.0"):
        group_advantages([1.0, 0.0], ["g", "g"], episode_ids=[0, 0])


def test_episodes_without_a_verdict_are_left_out_of_their_group(manager):
    task = ChatEpisodesTask(turns=1, rewards=(1.0, None, 0.0, None))
    (group,), counts = _run(task, manager, 1, group_size=4)
    assert [e.reward for e in group.episodes] == [1.0, 0.0]
    assert counts["dropped"] == 2
    assert len(training_batch(manager.manager.store, [group])) == 2


def test_a_group_with_no_verdict_is_run_again_then_fails(manager):
    task = ChatEpisodesTask(turns=1, rewards=(None,))
    with pytest.raises(RolloutError, match="no episode had a verdict in 2 runs"):
        _run(task, manager, 1, retries=1)


def test_finished_episode_groups_are_found_again_for_a_resumed_run(manager):
    """The group record is written with each episode's session; a resumed run rebuilds the groups from it."""
    task = ChatEpisodesTask(turns=2, rewrite_at=2)
    groups, _ = _run(task, manager, 2)
    store = manager.manager.store
    found = {g.key: g for g in untrained_groups(store)}
    assert sorted(found) == sorted(g.key for g in groups)
    for g in groups:
        again = found[g.key]
        assert [(e.session_id, e.request_ids, e.reward, e.tokens) for e in again.episodes] == \
            [(e.session_id, e.request_ids, e.reward, e.tokens) for e in g.episodes]  # fmt: skip
    store.mark_consumed([groups[0].key], 0)
    assert [g.key for g in untrained_groups(store)] == [groups[1].key]


def test_an_evaluation_runs_each_problem_samples_times_and_reports_each_problem(manager):
    """pass@1 over `samples` episodes a problem: the mean over every judged episode, and each problem's own
    [reward sum, judged episodes]; episodes without a verdict are counted as dropped, not as failures."""
    task = ChatEpisodesTask(turns=1, rewards=(1.0, 0.0, None))
    problems = task.held_out()[:2]

    async def go():
        config = RolloutConfig(group_size=2, max_concurrency=8)
        async with RolloutManager(task, manager.url, config, "ev", 0, lambda g: None) as rollout:
            return await rollout.evaluate(problems, "x", samples=3)

    result = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert result["samples"] == 3 and result["problems"] == 2
    assert result["dropped"] == 2  # the third episode of each problem has no verdict
    assert result["instances"] == {p.problem_id: [1.0, 2] for p in problems}
    assert result["reward_mean"] == 0.5


class _SeedSpy(FakeEngine):
    """A fake engine that records the sampling seed of every request it serves."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seeds: list[int | None] = []

    async def stream(self, request):
        self.seeds.append(request.params.seed)
        async for event in super().stream(request):
            yield event


def test_evaluations_draw_the_same_numbers_for_the_same_episode_and_rollouts_do_not(tok, tmp_path):
    """Common random numbers: two evaluations of a run send each episode's turns the same seeds (every turn its
    own, every episode its own), so only the weights can make them differ; training groups draw fresh ones."""
    engine = _SeedSpy(vocab_size=tok.vocab_size, reply_tokens=4, stop_token_id=tok.im_end_id)
    task = ChatEpisodesTask(turns=2, rewards=(1.0, 0.0))
    problems = task.held_out()

    async def go():
        config = RolloutConfig(group_size=2, max_concurrency=8)
        async with RolloutManager(task, m.url, config, "crn", 3, lambda g: None) as rollout:
            seen = []
            for label in ("start", "end"):
                engine.seeds.clear()
                await rollout.evaluate(problems, label, samples=2)
                seen.append(sorted(engine.seeds))
            engine.seeds.clear()
            rollout.submit(2, problems)
            while len(rollout.groups) < 2:
                await asyncio.sleep(0.01)
            return seen, sorted(engine.seeds)

    with ManagerThread({"fake-0": engine}, tok, tmp_path / "crn.sqlite") as m:
        (start, end), training = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert len(start) == len(problems) * 2 * 2  # problems x samples x turns
    assert start == end  # the same draws
    assert len(set(start)) == len(start)  # each episode and each turn its own
    assert not set(training) & set(start)


def test_a_chat_seed_is_varied_by_the_turn_it_samples():
    from reference.manager.chat import parse_chat, turn_seed

    def seed_of(messages):
        return parse_chat({"messages": messages, "seed": 41}).sampling.seed

    first = [{"role": "user", "content": "hi"}]
    second = first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert seed_of(first) == 41 == turn_seed(41, 0)  # a one-turn request keeps its seed
    assert seed_of(second) == turn_seed(41, 1) != 41 and seed_of(second) == seed_of(list(second))
    assert 0 <= turn_seed(2**63 - 1, 7) < 2**63 and turn_seed(41, 2) != turn_seed(41, 1)


def test_math_groups_go_through_the_same_seam_one_request_an_episode(tok, tmp_path):
    task = MathTask()
    engine = FakeEngine(vocab_size=task.tokenizer.vocab_size, reply_tokens=3)
    with ManagerThread({"fake-0": engine}, task.tokenizer, tmp_path / "m.sqlite") as m:
        groups, counts = _run(task, m, 2, group_size=4)
        batch = training_batch(m.manager.store, groups)
        assert counts["requests"] == 2  # one request a group, n=4
        for g in groups:
            assert len({e.session_id for e in g.episodes}) == 1
            assert [len(e.request_ids) for e in g.episodes] == [1] * 4
        assert len(batch) == 8
        assert all(sum(t.generated_mask) == t.num_generated > 0 for t in batch)
        assert {g.key for g in untrained_groups(m.manager.store)} == {g.key for g in groups}


def test_an_episode_must_name_its_requests():
    with pytest.raises(ValueError, match="names no request"):
        Episode("s", (), 1.0, True, 0, 0, 0)
    assert not Episode("s", (), None, False, 0, 0, 0).rewarded  # no verdict: nothing to train


def test_the_scripted_task_checks_its_config():
    with pytest.raises(ValueError, match="rewrite_at"):
        ChatEpisodesConfig(turns=2, rewrite_at=5)
    assert len(ChatEpisodesTask().sample_train(random.Random(0), 3)) == 3


def test_an_episode_in_flight_goes_on_across_a_weight_update(tok, tmp_path, http):
    """Partial rollout for episodes: the weights change after the episode's first turn; its later turns are
    sampled by the new version, each token keeps the version that sampled it, and the record holds both."""
    import threading
    import time

    engine = FakeEngine(vocab_size=tok.vocab_size, reply_tokens=6, stop_token_id=tok.im_end_id, token_delay_s=0.002)
    with ManagerThread({"fake-0": engine}, tok, tmp_path / "t.sqlite") as m:
        task = ChatEpisodesTask(turns=4)
        result: dict = {}
        runner = threading.Thread(target=lambda: result.update(groups=_run(task, m, 1, group_size=1)[0]))
        runner.start()
        deadline = time.monotonic() + 60
        while not m.manager.store.has_session("ep-g0-e0") and time.monotonic() < deadline:
            time.sleep(0.005)  # the first turn is recorded
        assert http("POST", f"{m.url}/admin/pause", {})[0] == 200
        assert http("POST", f"{m.url}/admin/update_weights", {"version": 1})[0] == 200
        assert http("POST", f"{m.url}/admin/resume", {})[0] == 200
        runner.join(60)
        (group,) = result["groups"]
        (episode,) = group.episodes
        (records,) = episode_records(m.manager.store, [episode])
    (record,) = records
    versions = [v for v, g in zip(record["versions"], record["generated_mask"], strict=True) if g]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert (episode.min_version, episode.max_version) == (0, 1)
