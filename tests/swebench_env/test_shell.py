"""The sandbox's command runner (`swebench_env.shell`): the same results as `docker exec`, and falling back to it."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

import swebench_env.shell as shell_module
from swebench_env.sandbox import Sandbox
from swebench_env.shell import RUNNER_DIED

pytestmark = pytest.mark.docker

# (command, timeout_s, workdir) whose results must not depend on how the command was started
COMMANDS = [
    ("echo out; echo err >&2; exit 3", 10, None),
    ("pwd; echo $PWD; echo $A $B", 10, "/tmp"),
    ("env | grep -v '^_=' | sort; umask; id; echo $0 $-; shopt login_shell", 10, None),
    ("cat; echo stdin-closed", 10, None),  # no stdin: /dev/null
    ("sleep 30 & echo the command ended; its background job is killed", 10, None),
    ("setsid sleep 30 > /dev/null 2>&1 & echo a session of its own is left alone", 10, None),
    ("head -c 600000 /dev/zero | tr '\\0' a; echo; echo end", 10, None),  # past the output limit
    ("printf '\\xff\\xfe bytes'", 10, None),
    ("kill -9 $$", 10, None),
    ("sleep 20", 1, None),  # killed at its timeout
    ("true", 10, "/nowhere"),  # a folder that does not exist: exit status 126 both ways
]


@pytest.fixture
def sandbox(sandbox_config):
    with Sandbox(sandbox_config) as sb:
        yield sb


def _result(r):
    return r.exit_code, r.timed_out, r.truncated, r.output


@pytest.mark.parametrize(("cmd", "timeout_s", "workdir"), COMMANDS)
def test_a_command_through_the_runner_gives_what_docker_exec_gives(sandbox_config, cmd, timeout_s, workdir):
    config = replace(sandbox_config, env={"A": "from-config"}, workdir="/testbed")
    with Sandbox(config) as sb:
        plain = sb.exec(cmd, timeout_s=timeout_s, workdir=workdir, env={"B": "per-command"})
        assert sb.start_shell()
        through = sb.exec(cmd, timeout_s=timeout_s, workdir=workdir, env={"B": "per-command"})
        assert sb._shell is not None and sb._shell.alive
    if workdir == "/nowhere":  # the error text is the daemon's or Python's
        assert (plain.exit_code, through.exit_code) == (126, 126)
        assert "/nowhere" in plain.output and "/nowhere" in through.output
        return
    assert _result(through) == _result(plain)


def test_a_command_that_kills_the_runner_gets_no_status_and_the_next_ones_use_docker_exec(sandbox):
    assert sandbox.start_shell()
    killed = sandbox.exec("pkill -9 -f 'python3 -c'; sleep 1; echo unreachable", timeout_s=10)
    assert (killed.exit_code, killed.timed_out, killed.output) == (-1, False, RUNNER_DIED)
    after = sandbox.exec("echo still here", timeout_s=10)
    assert (after.exit_code, after.output) == (0, "still here\n")
    assert sandbox.start_shell()  # a new runner
    assert sandbox.exec("ps -eo comm | grep -c python3", timeout_s=10).output == "1\n"


def test_a_runner_that_cannot_start_leaves_docker_exec(sandbox, monkeypatch):
    monkeypatch.setattr(shell_module, "RUNNER", "import sys; sys.stderr.write('no runner here'); sys.exit(1)")
    assert sandbox.start_shell() is False
    assert sandbox.exec("echo works", timeout_s=10).output == "works\n"


def test_commands_from_two_threads_at_once_both_run(sandbox):
    assert sandbox.start_shell()
    results = {}

    def run(i: int) -> None:
        results[i] = sandbox.exec(f"sleep 1; echo {i}", timeout_s=20)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert {i: (r.exit_code, r.output) for i, r in results.items()} == {i: (0, f"{i}\n") for i in range(3)}


def test_a_closed_sandbox_closes_its_runner(sandbox_config):
    sb = Sandbox(sandbox_config).start()
    assert sb.start_shell()
    runner = sb._shell
    sb.close()
    assert runner.alive is False


def test_a_command_that_forges_the_runners_answer_cannot_make_the_client_read_without_end(sandbox):
    assert sandbox.start_shell()
    forged = '{"exit": 0, "dropped": 0, "head": 999999999999, "tail": 0}'
    cmd = f"out=/proc/$(pgrep -f 'python3 -c' | head -1)/fd/1; echo '{forged}' > $out; head -c 3000000 /dev/zero > $out"
    result = sandbox.exec(cmd, timeout_s=20)
    assert (result.exit_code, result.output) == (-1, RUNNER_DIED)
    assert sandbox.exec("echo next", timeout_s=10).output == "next\n"  # docker exec from here on
