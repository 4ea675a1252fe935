"""mini-swe-agent, unmodified, as a rollout agent: its own loop, prompts and litellm model through the manager."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("minisweagent")

from core.errors import UserError  # noqa: E402
from reference.manager.manager import ManagerConfig  # noqa: E402
from swebench_env import cli  # noqa: E402
from swebench_env.agent import AgentConfig, ExitReason  # noqa: E402
from swebench_env.demos import SUBMIT_MARKER  # noqa: E402
from swebench_env.mini_swe import MiniSweAgent, RunnerEnvironment, load_config  # noqa: E402
from swebench_env.rollout import SweRolloutConfig, run_rollout  # noqa: E402
from swebench_env.runner import LocalRunner  # noqa: E402
from swebench_env.scripted import demonstration_manager  # noqa: E402
from swebench_env.suite import SUITE_DIR, load_suite, load_suite_demonstrations  # noqa: E402
from swebench_env.tasks import materialize_repo  # noqa: E402

TOKEN = "mini-test-token"
IDS = ("swesuite__dateranges-2", "swesuite__slugkit-3")


@pytest.fixture(scope="module")
def pairs():
    demos = {d.instance_id: d for d in load_suite_demonstrations("train")}
    return [(t, demos[t.instance_id]) for t in load_suite("train") if t.instance_id in IDS]


@pytest.fixture(scope="module")
def manager(pairs, tmp_path_factory):
    """A manager with an admin token whose engine plays the demonstrations with bash calls only (mini-swe-agent
    has no `submit` tool: the last step runs the submit command)."""
    store = tmp_path_factory.mktemp("mini") / "t.sqlite"
    with demonstration_manager(pairs, store=store, config=ManagerConfig(admin_token=TOKEN), submit_tool=False) as m:
        yield m


def test_the_unmodified_agent_resolves_demonstrated_tasks_and_its_tokens_are_stored_exactly(manager, pairs, tmp_path,
                                                                                            capsys):  # fmt: skip
    """Through the rollout command: mini-swe-agent's DefaultAgent and LitellmModel talk to the manager, each
    patch is graded and the reward stored; the store's consistency check finds 0 token mismatches."""
    from reference.consistency import check_store
    from reference.export import branch_records
    from reference.model import default_model
    from reference.tokenizer import default_tokenizer
    from reference.trainer.batch import Trajectory, collate

    (tmp_path / "token").write_text(TOKEN)
    out = tmp_path / "out"
    argv = ["rollout", "--agent", "mini-swe-agent", "--tasks", str(SUITE_DIR / "train.jsonl"), "--ids", *IDS,
            "--base-url", manager.url, "--out", str(out), "--admin-token-file", str(tmp_path / "token"),
            "--run-id", "mini", "--sandbox", "local"]  # fmt: skip
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("pass@1: 2/2 = 100.0%")
    results = {r["instance_id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    steps = {t.instance_id: len(d.steps) for t, d in pairs}
    for iid, r in results.items():
        got = (r["exit_reason"], r["turns"], r["format_errors"], r["reward_stored"])
        assert got == ("submitted", steps[iid], 0, True)
    for iid in IDS:
        tree = manager.call(manager.manager.trajectory(f"mini:{iid}"))
        assert tree["annotations"]["reward"] == 1.0
    report = check_store(manager.store, default_model()[0], default_tokenizer())
    assert report.token_mismatches == 0
    assert report.requests >= sum(steps.values())
    # Trainable: each episode is one branch the trainer's record type takes, with its reward and its
    # generated tokens (every model turn) marked for the loss.
    records = list(branch_records(manager.store, [f"mini:{iid}" for iid in IDS]))
    trajectories = [Trajectory.from_export(r) for r in records]
    assert [t.reward for t in trajectories] == [1.0, 1.0]
    assert all(t.num_generated > 0 and 0 < sum(t.generated_mask) < len(t.token_ids) for t in trajectories)
    batch = collate(trajectories, [0.5, -0.5], pad_id=0)
    assert int(batch.mask.sum()) == sum(t.num_generated for t in trajectories)


def test_the_step_limit_ends_the_episode_and_the_checkout_diff_is_graded(manager, pairs):
    task, demo = pairs[0]
    agent = MiniSweAgent(AgentConfig(max_turns=2))
    [result] = run_rollout([task], agent, SweRolloutConfig(manager.url, run_id="limit", admin_token=TOKEN))
    assert len(demo.steps) > 2
    assert (result.exit_reason, result.turns, result.resolved, result.reward, result.reward_stored) == (
        "turn_limit", 2, False, 0.0, True)  # fmt: skip


def test_replies_without_a_tool_call_end_the_episode_by_mini_swe_agents_format_error_rule(manager, tmp_path):
    """A task the engine has no demonstration for gets plain text back: three format errors in a row."""
    task = next(t for t in load_suite("train") if t.instance_id not in IDS)
    runner = LocalRunner(materialize_repo(task, tmp_path / "repo"))
    episode = MiniSweAgent(AgentConfig(max_turns=10)).run(task, runner, manager.url, "mini-format")
    assert (episode.exit_reason, episode.turns, episode.format_errors, episode.commands) == (
        ExitReason.FORMAT_ERRORS, 3, 3, 0)  # fmt: skip
    assert episode.patch == ""


def test_an_unreachable_server_is_an_api_error_not_a_crash(pairs, tmp_path, monkeypatch):
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    task = pairs[0][0]
    runner = LocalRunner(materialize_repo(task, tmp_path / "repo"))
    agent = MiniSweAgent(AgentConfig(model="tiny", request_timeout_s=5))
    episode = agent.run(task, runner, "http://127.0.0.1:9", "nobody")
    assert episode.exit_reason == ExitReason.API_ERROR
    assert "Connection" in episode.error


class _Result:
    def __init__(self, exit_code: int, output: str, timed_out: bool = False, truncated: bool = False) -> None:
        self.exit_code, self.output, self.timed_out, self.truncated = exit_code, output, timed_out, truncated


class _Runner:
    """Records commands and answers each with the next canned result."""

    def __init__(self, *results: _Result) -> None:
        self.results, self.commands = list(results), []

    def exec(self, cmd: str, timeout_s: float, workdir: str | None = None) -> _Result:
        self.commands.append((cmd, timeout_s, workdir))
        return self.results.pop(0)


def test_the_environment_submits_only_on_the_marker_with_exit_code_0():
    from minisweagent.exceptions import Submitted

    runner = _Runner(_Result(1, f"{SUBMIT_MARKER}\ndiff"), _Result(0, f"\n{SUBMIT_MARKER}\ndiff --git a/x b/x\n"))
    env = RunnerEnvironment(runner, timeout_s=7, cwd="/testbed", env={"PAGER": "cat"})
    assert env.execute({"command": "false"}) == {"output": f"{SUBMIT_MARKER}\ndiff", "returncode": 1,
                                                 "exception_info": ""}  # fmt: skip
    with pytest.raises(Submitted) as submitted:
        env.execute({"command": "submit"})
    assert submitted.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "diff --git a/x b/x\n"}
    assert runner.commands[0] == ("export PAGER=cat; false", 7, "/testbed")
    assert env.commands == 2 and not env.submission_cut_short


def test_a_command_past_its_timeout_is_reported_as_mini_swe_agent_reports_it():
    env = RunnerEnvironment(_Runner(_Result(137, "partial", timed_out=True)), timeout_s=3)
    output = env.execute({"command": "sleep 10"})
    assert output["returncode"] == 137 and "timed out after 3 s" in output["exception_info"]
    assert output["extra"]["exception_type"] == "TimeoutExpired"


def test_config_files_are_checked_with_an_error_naming_the_file(tmp_path):
    shipped = load_config()
    assert "{{task}}" in shipped["agent"]["instance_template"]
    with pytest.raises(UserError, match=r"config '.*missing.yaml' cannot be read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("agent:\n  system_template: hi\n")
    with pytest.raises(UserError, match=r"bad.yaml': 'agent' must hold 'system_template' and 'instance_template'"):
        load_config(tmp_path / "bad.yaml")


def test_mini_config_is_only_for_mini_swe_agent_and_a_bad_one_is_one_line(manager, tmp_path, capsys):
    base = ["rollout", "--tasks", str(SUITE_DIR / "train.jsonl"), "--ids", IDS[0], "--base-url", manager.url,
            "--sandbox", "local"]  # fmt: skip
    assert cli.main([*base, "--out", str(tmp_path / "a"), "--mini-config", str(tmp_path / "x.yaml")]) == 2
    assert capsys.readouterr().err == "error: --mini-config is for --agent mini-swe-agent, not --agent builtin\n"
    argv = [*base, "--out", str(tmp_path / "b"), "--agent", "mini-swe-agent", "--mini-config", str(tmp_path / "x.yaml")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: mini-swe-agent config ") and "x.yaml' cannot be read" in err and err.count("\n") == 1


@pytest.mark.docker
def test_the_unmodified_agent_works_in_a_docker_sandbox(manager, pairs, base_image):
    """Commands in a sandbox with the checkout at /testbed (mini-swe-agent's SWE-bench layout), graded in a
    fresh one."""
    from swebench_env.rollout import environment

    workspace, grader = environment("docker", base_image)
    agent = MiniSweAgent(AgentConfig(max_turns=len(pairs[1][1].steps) + 1))
    config = SweRolloutConfig(manager.url, run_id="mini-docker", admin_token=TOKEN)
    [result] = run_rollout([pairs[1][0]], agent, config, grader, workspace)
    assert (result.exit_reason, result.resolved, result.reward, result.reward_stored, result.error) == (
        "submitted", True, 1.0, True, None)  # fmt: skip


def test_only_model_classes_that_reach_an_openai_server_are_accepted(tmp_path):
    from minisweagent.config import builtin_config_dir

    assert MiniSweAgent().model_class().__name__ == "LitellmModel"  # the shipped SWE-bench config: tool calls
    config = yaml.safe_load((builtin_config_dir / "mini_textbased.yaml").read_text())
    config["model"]["model_class"] = "litellm_textbased"
    (tmp_path / "text.yaml").write_text(yaml.safe_dump(config))
    assert MiniSweAgent(config_file=tmp_path / "text.yaml").model_class().__name__ == "LitellmTextbasedModel"
    config["model"]["model_class"] = "portkey"
    (tmp_path / "portkey.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(UserError, match="model_class 'portkey' cannot talk to the trajectory manager; use one of: "
                                        "litellm, litellm_textbased"):  # fmt: skip
        load_config(tmp_path / "portkey.yaml")


def test_a_seed_in_the_config_goes_into_every_call_of_the_model():
    """mini-swe-agent sends its model_kwargs with each call: one seed, which the manager varies by turn."""
    seeded = MiniSweAgent(AgentConfig(model="m", seed=5))._model_config("http://127.0.0.1:9/v1")
    assert seeded["model_kwargs"]["seed"] == 5
    assert "seed" not in MiniSweAgent(AgentConfig(model="m"))._model_config("http://127.0.0.1:9/v1")["model_kwargs"]
