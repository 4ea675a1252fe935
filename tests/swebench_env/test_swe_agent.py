"""The built-in bash-tool agent against a real trajectory manager, and the local command runner.

The manager's engine is scripted (the demonstration engine, or `ScriptedEngine` replies), so every
model turn is known; commands run with `LocalRunner` in a checkout of a suite task.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from reference.engine.fake import ScriptedEngine
from reference.manager.embedded import ManagerThread
from reference.tokenizer import default_tokenizer
from swebench_env.agent import FORMAT_ERROR, AgentConfig, BashAgent, ExitReason, final_patch, observation
from swebench_env.evaluation import evaluate_locally, judged_files
from swebench_env.runner import LocalRunner
from swebench_env.scripted import demonstration_manager, replay_demonstration
from swebench_env.suite import load_suite, load_suite_demonstrations
from swebench_env.tasks import materialize_repo

INSTANCE = "swesuite__dateranges-1"


@pytest.fixture(scope="module")
def task_and_demo():
    tasks, demos = load_suite("train"), load_suite_demonstrations("train")
    return next((t, d) for t, d in zip(tasks, demos, strict=True) if t.instance_id == INSTANCE)


@pytest.fixture
def checkout(task_and_demo, tmp_path):
    return materialize_repo(task_and_demo[0], tmp_path / "repo")


def _scripted_manager(reply, max_context: int = 8192) -> ManagerThread:
    """A manager whose engine answers every turn with the text `reply(prompt_ids)`, ended by <|im_end|>."""
    tok = default_tokenizer()
    engine = ScriptedEngine(lambda ids: [*tok.encode(reply(ids)), tok.im_end_id], vocab_size=tok.vocab_size,
                            max_context=max_context)  # fmt: skip
    return ManagerThread({"scripted": engine}, tok)


def _stored_text(manager: ManagerThread, session_id: str) -> tuple[dict, str]:
    tree = manager.call(manager.manager.trajectory(session_id))
    return tree, default_tokenizer().decode(tree["branches"][0]["token_ids"])


def test_replayed_demonstration_submits_a_patch_that_resolves(task_and_demo, checkout):
    task, demo = task_and_demo
    with demonstration_manager([(task, demo)]) as m:
        episode = replay_demonstration(task, demo, m.url, LocalRunner(checkout), session_id="demo-1")
        tree, text = _stored_text(m, "demo-1")
    assert episode.exit_reason == ExitReason.SUBMITTED
    assert episode.turns == len(demo.steps)
    assert episode.commands == len(demo.steps) - 1  # the last step is the submit call
    assert episode.format_errors == 0
    assert episode.error is None
    assert evaluate_locally(task, episode.patch).resolved
    assert tree["num_branches"] == 1  # every turn spliced back as the tokens sampled: one branch
    assert len(tree["branches"][0]["request_ids"]) == len(demo.steps)
    assert text.count("<tool_response>\nexit code 0\n") == len(demo.steps) - 1
    assert text.endswith('{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>')


def test_replies_without_tool_calls_are_format_errors_until_the_turn_limit(task_and_demo, checkout):
    with _scripted_manager(lambda ids: "I will now think very hard about this.") as m:
        episode = BashAgent(AgentConfig(max_turns=3)).run(task_and_demo[0], LocalRunner(checkout), m.url, "garbage")
        tree, text = _stored_text(m, "garbage")
    assert episode.exit_reason == ExitReason.TURN_LIMIT
    assert (episode.turns, episode.format_errors, episode.commands) == (3, 3, 0)
    assert episode.patch == ""
    assert tree["num_branches"] == 1
    assert len(tree["branches"][0]["request_ids"]) == 3
    assert text.count(FORMAT_ERROR) == 2  # the third one is never sent: the turn limit ends the episode


def test_unknown_tools_and_bad_arguments_are_format_errors(task_and_demo, checkout):
    calls = iter(['{"name": "python", "arguments": {"code": "1"}}', '{"name": "bash", "arguments": {"cmd": "ls"}}'])
    with _scripted_manager(lambda ids: f"<tool_call>\n{next(calls)}\n</tool_call>") as m:
        episode = BashAgent(AgentConfig(max_turns=2)).run(task_and_demo[0], LocalRunner(checkout), m.url, "bad-calls")
        _, text = _stored_text(m, "bad-calls")
    assert (episode.exit_reason, episode.format_errors, episode.commands) == (ExitReason.TURN_LIMIT, 2, 0)
    assert "That call was not run: there is no tool 'python'." in text


def test_turn_limit_ends_a_demonstration_early_with_the_diff_so_far(task_and_demo, checkout):
    task, demo = task_and_demo
    fix_step = next(i for i, s in enumerate(demo.steps) if s.command.startswith("sed -i"))
    config = AgentConfig(max_turns=fix_step + 1)
    with demonstration_manager([(task, demo)]) as m:
        episode = replay_demonstration(task, demo, m.url, LocalRunner(checkout), config, session_id="short")
        tree = m.call(m.manager.trajectory("short"))
    assert episode.exit_reason == ExitReason.TURN_LIMIT
    assert episode.turns == fix_step + 1
    assert len(tree["branches"][0]["request_ids"]) == fix_step + 1
    assert "+        return (self.end - self.start).days + 1" in episode.patch  # autosubmitted, as SWE-agent does


def test_a_conversation_beyond_the_context_ends_the_episode(task_and_demo, checkout):
    with _scripted_manager(lambda ids: "hello", max_context=64) as m:
        episode = BashAgent().run(task_and_demo[0], LocalRunner(checkout), m.url, "long")
    assert episode.exit_reason == ExitReason.CONTEXT_LIMIT
    assert "context" in episode.error


class _Overloaded(BaseHTTPRequestHandler):
    """Answers 429 (Retry-After: 0) to the first `overloaded` chat calls, then a submit tool call."""

    overloaded = 2
    calls = 0

    def do_POST(self):  # noqa: N802 - the stdlib's name
        type(self).bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        type(self).calls += 1
        if type(self).calls <= self.overloaded:
            return self._send(429, {"error": {"message": "busy", "code": "overloaded"}}, {"Retry-After": "0"})
        call = {"id": "c1", "type": "function", "function": {"name": "submit", "arguments": "{}"}}
        choice = {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                  "finish_reason": "tool_calls"}  # fmt: skip
        return self._send(
            200, {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
        )

    def _send(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_server():
    """`stub_server(overloaded)` -> (url, handler class): a fake OpenAI server that is busy at first."""
    servers = []

    def start(overloaded: int):
        handler = type("Handler", (_Overloaded,), {"overloaded": overloaded, "calls": 0, "bodies": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}", handler

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


FAST_RETRIES = {"model": "m", "max_retries": 2, "retry_base_s": 0.001, "retry_max_s": 0.01}


def test_overloaded_answers_are_retried(task_and_demo, checkout, stub_server):
    url, handler = stub_server(overloaded=2)
    episode = BashAgent(AgentConfig(**FAST_RETRIES)).run(task_and_demo[0], LocalRunner(checkout), url, "s")
    assert episode.exit_reason == ExitReason.SUBMITTED
    assert handler.calls == 3


def test_retries_run_out_and_the_episode_ends_with_the_api_error(task_and_demo, checkout, stub_server):
    url, handler = stub_server(overloaded=100)
    episode = BashAgent(AgentConfig(**FAST_RETRIES)).run(task_and_demo[0], LocalRunner(checkout), url, "s")
    assert episode.exit_reason == ExitReason.API_ERROR
    assert handler.calls == 3  # the first try and max_retries more
    assert episode.error == "HTTP 429: busy"


def test_a_seed_in_the_config_goes_with_every_model_call(task_and_demo, checkout, stub_server):
    """An evaluation fixes each episode's seed (the manager varies it by turn); otherwise none is sent."""
    url, handler = stub_server(overloaded=1)
    BashAgent(AgentConfig(**FAST_RETRIES, seed=77)).run(task_and_demo[0], LocalRunner(checkout), url, "s")
    assert [b["seed"] for b in handler.bodies] == [77, 77]  # the retried call too
    url, handler = stub_server(overloaded=0)
    BashAgent(AgentConfig(**FAST_RETRIES)).run(task_and_demo[0], LocalRunner(checkout), url, "s")
    assert "seed" not in handler.bodies[0]
    with pytest.raises(ValueError, match="AgentConfig.seed must be None or an integer"):
        AgentConfig(seed=-1)


def test_an_unreachable_server_ends_the_episode(task_and_demo, checkout):
    episode = BashAgent(AgentConfig(**FAST_RETRIES)).run(
        task_and_demo[0], LocalRunner(checkout), "http://127.0.0.1:9", "s"
    )
    assert episode.exit_reason == ExitReason.API_ERROR
    assert episode.error.startswith("APIConnectionError")


def test_final_patch_leaves_out_the_judged_tests_and_keeps_new_files(task_and_demo, checkout):
    task = task_and_demo[0]
    test_file = checkout / judged_files(task)[0]
    test_file.write_text(test_file.read_text() + "\n# edited by the agent\n")
    (checkout / "dateranges.py").write_text((checkout / "dateranges.py").read_text() + "\n# fixed\n")
    (checkout / "notes.txt").write_text("new file\n")
    patch, error = final_patch(task, LocalRunner(checkout), AgentConfig())
    assert error is None
    assert [line for line in patch.splitlines() if line.startswith("diff --git")] == [
        "diff --git a/dateranges.py b/dateranges.py",
        "diff --git a/notes.txt b/notes.txt",
    ]


def test_observation_keeps_the_head_and_tail_of_a_long_output():
    config = AgentConfig(max_observation_chars=20, command_timeout_s=5)
    assert observation(0, "x" * 10 + "y" * 30 + "z" * 10, False, config) == (
        "exit code 0\n" + "x" * 10 + "\n[... 30 characters left out ...]\n" + "z" * 10
    )
    assert observation(-1, "", True, config) == "The command was stopped after 5 s.\n(no output)"


def test_local_runner_reports_failures_as_results(tmp_path):
    runner = LocalRunner(tmp_path)
    result = runner.exec("echo out; echo err >&2; exit 3", timeout_s=10)
    assert (result.exit_code, result.output, result.timed_out) == (3, "out\nerr\n", False)
    assert runner.exec("pwd", timeout_s=10, workdir="/").output == "/\n"


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie awaiting its reaper is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_local_runner_kills_the_command_and_its_children_at_the_timeout(tmp_path):
    start = time.monotonic()
    result = LocalRunner(tmp_path).exec("sleep 30 & echo $!; sleep 30", timeout_s=0.5)
    assert time.monotonic() - start < 10
    assert (result.exit_code, result.timed_out) == (-1, True)
    child = int(result.output)
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child)


def test_local_runner_kills_what_a_command_left_running(tmp_path):
    result = LocalRunner(tmp_path).exec("sleep 30 & echo $!", timeout_s=10)
    assert (result.exit_code, result.timed_out) == (0, False)
    child = int(result.output)
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child)


def test_local_runner_keeps_the_head_and_tail_of_long_output(tmp_path):
    result = LocalRunner(tmp_path, output_limit_bytes=100).exec("seq 1 10000", timeout_s=10)
    assert result.truncated
    assert result.output.startswith("1\n2\n")
    assert result.output.endswith("9999\n10000\n")
    assert "bytes of output left out" in result.output


def test_the_docker_sandbox_satisfies_the_runner_protocol():
    sandbox = pytest.importorskip("swebench_env.sandbox")
    params = inspect.signature(sandbox.Sandbox.exec).parameters
    assert list(params)[:4] == ["self", "cmd", "timeout_s", "workdir"]
    fields = set(sandbox.ExecResult.__dataclass_fields__)
    assert {"exit_code", "output", "timed_out", "truncated"} <= fields
