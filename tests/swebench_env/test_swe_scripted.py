"""The demonstration engine: step messages, choosing the demonstration and the step, and `replay` end to end."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from reference.manager.chat import ChatRenderer
from reference.manager.tools import parse_tool_calls
from reference.tokenizer import default_tokenizer
from swebench_env import cli
from swebench_env.agent import TOOLS, AgentConfig, instance_messages
from swebench_env.demos import SUBMIT_COMMAND, Step
from swebench_env.scripted import NO_DEMONSTRATION, DemonstrationScript, step_message
from swebench_env.suite import SUITE_DIR, load_suite, load_suite_demonstrations

TRAIN = str(SUITE_DIR / "train.jsonl")
TRAIN_DEMOS = str(SUITE_DIR / "demonstrations" / "train.jsonl")


@pytest.fixture(scope="module")
def pairs():
    return list(zip(load_suite("train")[:3], load_suite_demonstrations("train")[:3], strict=True))


def _prompt(task, assistant_turns: list[str]) -> list[int]:
    """The token ids the manager sends the engine for `task` after these assistant turns."""
    messages = instance_messages(task, AgentConfig())
    for text in assistant_turns:
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "exit code 0\n"}]
    return ChatRenderer(default_tokenizer()).render(messages, TOOLS)


def test_a_step_is_a_hermes_bash_call_and_the_last_step_a_submit_call():
    step = Step("Let me look.", "grep -n 'def f' x.py | head")
    content, calls = parse_tool_calls(step_message(step))
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("bash", {"command": "grep -n 'def f' x.py | head"})
    ]
    _, calls = parse_tool_calls(step_message(Step("Done.", SUBMIT_COMMAND)))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("submit", "{}")]


def test_the_script_picks_the_demonstration_by_problem_statement_and_the_step_by_turns(pairs):
    tok = default_tokenizer()
    script = DemonstrationScript(pairs, tok)
    (_, first), (task, demo) = pairs[0], pairs[1]
    assert script.demonstration(_prompt(task, [])) is demo
    assert script.demonstration(_prompt(pairs[0][0], [])) is first
    for k in range(3):
        reply = script(_prompt(task, ["thinking"] * k))
        assert tok.decode(reply) == step_message(demo.steps[k]) + "<|im_end|>"
    past_the_end = script(_prompt(task, ["thinking"] * (len(demo.steps) + 2)))
    assert tok.decode(past_the_end) == step_message(demo.steps[-1]) + "<|im_end|>"


def test_a_conversation_without_a_known_problem_statement_gets_no_tool_call(pairs):
    tok = default_tokenizer()
    other = replace(pairs[0][0], problem_statement="Something else entirely is broken.")
    assert tok.decode(DemonstrationScript(pairs, tok)(_prompt(other, []))) == NO_DEMONSTRATION + "<|im_end|>"


def test_mismatched_or_ambiguous_pairs_are_refused(pairs):
    (task, demo), (other, _) = pairs[0], pairs[1]
    with pytest.raises(ValueError, match="is paired with task"):
        DemonstrationScript([(other, demo)], default_tokenizer())
    twin = replace(other, problem_statement=task.problem_statement)
    with pytest.raises(ValueError, match="have the same problem statement"):
        DemonstrationScript([(task, demo), (twin, replace(demo, instance_id=twin.instance_id))], default_tokenizer())


def test_replay_command_grades_and_stores_two_demonstrations(tmp_path, capsys):
    ids = ["swesuite__dateranges-1", "swesuite__rpncalc-2"]
    out = tmp_path / "replay"
    argv = ["replay", "--tasks", TRAIN, "--demos", TRAIN_DEMOS, "--out", str(out), "--ids", *ids, "--sandbox", "local"]
    code = cli.main(argv)
    stdout = capsys.readouterr().out
    assert code == 0
    assert "replayed 2 demonstrations: 2 resolved" in stdout
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["instance_id"], r["resolved"], r["reward"], r["reward_stored"]) for r in results) == [
        (ids[0], True, 1.0, True),
        (ids[1], True, 1.0, True),
    ]
    assert (out / "trajectories.sqlite").is_file()


def test_replay_refuses_tasks_without_a_demonstration(tmp_path, capsys):
    held_out = str(SUITE_DIR / "held_out.jsonl")
    code = cli.main(["replay", "--tasks", held_out, "--demos", TRAIN_DEMOS, "--out", str(tmp_path / "x")])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"error: {TRAIN_DEMOS} has no demonstration for 'swesuite__semver-1'")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_replayed_trajectories_hold_exactly_the_engine_tokens(pairs, tmp_path):
    """The consistency check (`python -m reference check`): 0 token mismatches. Slow: it loads torch."""
    from reference.consistency import check_store
    from reference.model import default_model
    from swebench_env.runner import LocalRunner
    from swebench_env.scripted import demonstration_manager, replay_demonstration
    from swebench_env.tasks import materialize_repo

    with demonstration_manager(pairs[:2], store=tmp_path / "t.sqlite") as m:
        for task, demo in pairs[:2]:
            runner = LocalRunner(materialize_repo(task, tmp_path / task.instance_id))
            replay_demonstration(task, demo, m.url, runner, session_id=f"s-{task.instance_id}")
        report = check_store(m.store, default_model()[0], default_tokenizer())
    assert (report.sessions, report.branches) == (2, 2)
    assert report.requests == sum(len(d.steps) for _, d in pairs[:2])
    assert report.token_mismatches == 0
