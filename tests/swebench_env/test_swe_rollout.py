"""Rollouts against a running manager: episodes, grading, rewards stored in the sessions, the CLI."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import replace

import pytest

from core.errors import UserError
from reference.manager.manager import ManagerConfig
from swebench_env import cli
from swebench_env.agent import AgentConfig, BashAgent, Episode, ExitReason
from swebench_env.evaluation import Evaluation, grade
from swebench_env.rollout import SweRolloutConfig, environment, make_agent, run_rollout
from swebench_env.scripted import demonstration_manager
from swebench_env.suite import SUITE_DIR, load_suite, load_suite_demonstrations

TOKEN = "rollout-test-token"
IDS = ("swesuite__dateranges-2", "swesuite__lrucache-1", "swesuite__slugkit-3")


@pytest.fixture(scope="module")
def tasks():
    chosen = [t for t in load_suite("train") if t.instance_id in IDS]
    assert [t.instance_id for t in chosen] == list(IDS)
    return chosen


@pytest.fixture(scope="module")
def manager(tasks, tmp_path_factory):
    """A manager with an admin token whose engine plays the chosen tasks' demonstrations."""
    demos = {d.instance_id: d for d in load_suite_demonstrations("train")}
    store = tmp_path_factory.mktemp("rollout") / "t.sqlite"
    config = ManagerConfig(admin_token=TOKEN)
    with demonstration_manager([(t, demos[t.instance_id]) for t in tasks], store=store, config=config) as m:
        yield m


def _reward(manager, session_id: str):
    tree = manager.call(manager.manager.trajectory(session_id))
    return tree["annotations"].get("reward"), [b["reward"] for b in tree["branches"]]


def test_a_rollout_grades_every_task_and_stores_the_rewards(tasks, manager):
    config = SweRolloutConfig(manager.url, concurrency=2, run_id="r1", admin_token=TOKEN)
    results = run_rollout(tasks, BashAgent(AgentConfig(max_turns=12)), config)
    assert [(r.instance_id, r.exit_reason, r.resolved, r.reward, r.reward_stored) for r in results] == [
        (t.instance_id, "submitted", True, 1.0, True) for t in tasks
    ]
    assert all(r.error is None for r in results)
    for r in results:
        assert _reward(manager, r.session_id) == (1.0, [1.0])


def test_the_grader_is_pluggable_and_its_verdict_is_the_reward(tasks, manager):
    def never(task, patch):
        return Evaluation(task.instance_id, True, {}, grade(task, {}), "")

    config = SweRolloutConfig(manager.url, concurrency=1, run_id="r2", admin_token=TOKEN)
    [result] = run_rollout(tasks[:1], BashAgent(AgentConfig()), config, grader=never)
    assert (result.exit_reason, result.resolved, result.reward, result.reward_stored) == ("submitted", False, 0.0, True)
    assert _reward(manager, result.session_id) == (0.0, [0.0])


def test_a_wrong_admin_token_leaves_the_reward_unstored(tasks, manager):
    config = SweRolloutConfig(manager.url, concurrency=1, run_id="r3", admin_token="wrong")
    [result] = run_rollout(tasks[:1], BashAgent(AgentConfig()), config)
    assert (result.resolved, result.reward_stored) == (True, False)
    assert result.error.startswith("the manager refused the reward (HTTP 401)")
    assert _reward(manager, result.session_id) == (None, [None])


class _FailingAgent:
    """Ends every episode on an API error, as when the manager is down."""

    def run(self, task, runner, manager_url, session_id):
        return Episode(task.instance_id, session_id, ExitReason.API_ERROR, 1, 0, 0, "", "HTTP 503: no engine",
                       0.0, 0.0, 0.0)  # fmt: skip


def test_an_episode_cut_by_an_api_error_gets_no_reward(tasks, manager):
    config = SweRolloutConfig(manager.url, concurrency=1, run_id="r4", admin_token=TOKEN)
    [result] = run_rollout(tasks[:1], _FailingAgent(), config)
    assert (result.exit_reason, result.reward, result.reward_stored) == ("api_error", None, False)
    assert result.error == "no reward stored: the episode ended on an API error (HTTP 503: no engine)"


def test_a_broken_instance_does_not_stop_the_rollout(tasks, manager):
    broken = replace(tasks[0], instance_id="broken-1", base_commit="0" * 40)  # not in its bundle
    config = SweRolloutConfig(manager.url, concurrency=2, run_id="r5", admin_token=TOKEN)
    results = run_rollout([broken, tasks[1]], BashAgent(AgentConfig()), config)
    assert [(r.exit_reason, r.resolved, r.reward) for r in results] == [
        ("crashed", False, None),
        ("submitted", True, 1.0),
    ]
    assert results[0].error.startswith("workspace or agent failed: GitError")


def test_the_rollout_command_writes_results_and_prints_pass_at_1(manager, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    out = tmp_path / "out"
    argv = ["rollout", "--tasks", str(SUITE_DIR / "train.jsonl"), "--ids", *IDS[:2], "--base-url", manager.url,
            "--out", str(out), "--admin-token-file", str(token_file), "--run-id", "cli"]  # fmt: skip
    argv += ["--sandbox", "local"]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[-1] == "pass@1: 2/2 = 100.0%  (rewards stored: 2; '!' = not stored, '-' = no reward)"
    assert sorted(json.loads(line)["session_id"] for line in (out / "results.jsonl").read_text().splitlines()) == [
        f"cli:{i}" for i in IDS[:2]
    ]
    assert json.loads((out / "summary.json").read_text())["pass@1"] == 1.0
    assert json.loads((out / "config.json").read_text())["rollout"]["admin_token"] == "<set>"


def test_the_rollout_command_refuses_a_manager_that_does_not_answer(tmp_path, capsys):
    argv = ["rollout", "--tasks", str(SUITE_DIR / "train.jsonl"), "--base-url", "http://127.0.0.1:9",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("error: no trajectory manager answers at http://127.0.0.1:9: ")
    assert not (tmp_path / "out").exists()


def test_unknown_agents_and_session_urls_are_refused(manager):
    with pytest.raises(UserError, match="unknown agent 'swe-agent'; valid choices: builtin, mini-swe-agent"):
        make_agent("swe-agent", AgentConfig())
    with pytest.raises(ValueError, match="not a session URL"):
        SweRolloutConfig(f"{manager.url}/s/abc/v1")


@contextmanager
def _tiny_model_manager(store=":memory:"):
    from reference.engine.process import EngineProcess, EngineSpec
    from reference.manager.embedded import ManagerThread
    from reference.tokenizer import default_tokenizer

    with (
        EngineProcess(EngineSpec(max_batch=2, torch_threads=1)) as proc,
        ManagerThread({"tiny": proc.client()}, default_tokenizer(), store) as m,
    ):
        yield m


@pytest.mark.slow
def test_the_tiny_random_model_ends_by_the_turn_limit_with_reward_0(tasks):
    """The default engine (a random-init tiny Qwen3 on CPU) writes no valid tool call: the episode runs to
    the turn limit on format errors, its empty patch resolves nothing, and the reward 0 is stored."""
    with _tiny_model_manager() as m:
        agent = BashAgent(AgentConfig(max_turns=2, max_tokens=24))
        [result] = run_rollout(tasks[:1], agent, SweRolloutConfig(m.url, run_id="tiny"))
        stored = _reward(m, result.session_id)
    assert (result.exit_reason, result.turns, result.format_errors) == ("turn_limit", 2, 2)
    assert (result.resolved, result.reward, result.reward_stored) == (False, 0.0, True)
    assert stored == (0.0, [0.0])


@pytest.mark.docker
@pytest.mark.slow
def test_the_tiny_model_rolls_out_8_tasks_in_sandboxes_with_rewards_stored_and_tokens_consistent(base_image, tmp_path):
    """End to end: the default engine through the manager, each episode in its own sandbox, each patch graded
    in a fresh one, the reward stored with its session; the store's consistency check finds 0 mismatches."""
    from reference.consistency import check_store
    from reference.model import default_model
    from reference.tokenizer import default_tokenizer

    eight = load_suite("train")[::4][:8]
    workspace, grader = environment("docker", base_image)
    with _tiny_model_manager(tmp_path / "t.sqlite") as m:
        config = SweRolloutConfig(m.url, concurrency=2, run_id="tiny8")
        results = run_rollout(eight, BashAgent(AgentConfig(max_turns=2, max_tokens=16)), config, grader, workspace)
        stored = [_reward(m, r.session_id) for r in results]
        report = check_store(m.store, default_model()[0], default_tokenizer())
    assert [(r.exit_reason, r.resolved, r.reward, r.reward_stored, r.error) for r in results] == [
        ("turn_limit", False, 0.0, True, None)
    ] * 8
    assert all(r.fail_to_pass[0] == 0 and r.pass_to_pass[0] == r.pass_to_pass[1] for r in results)  # really graded
    assert stored == [(0.0, [0.0])] * 8
    assert (report.sessions, report.requests, report.token_mismatches) == (8, 16, 0)


@pytest.mark.docker
def test_demonstrations_replayed_in_sandboxes_resolve_their_tasks(tmp_path, capsys, base_image):
    out = tmp_path / "replay"
    argv = ["replay", "--tasks", str(SUITE_DIR / "train.jsonl"), "--demos", str(SUITE_DIR / "demonstrations" /
            "train.jsonl"), "--out", str(out), "--ids", *IDS, "--image", base_image]  # fmt: skip
    assert cli.main(argv) == 0
    assert "replayed 3 demonstrations: 3 resolved" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["sandbox"] == "docker"
