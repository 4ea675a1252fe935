"""The command runner's stream on a socket pair, no Docker: closing it under a waiting command."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

from swebench_env.shell import Shell


def _frame(payload: bytes, stream: int = 1) -> bytes:
    return bytes([stream, 0, 0, 0]) + len(payload).to_bytes(4, "big") + payload


class _Api:
    """The two calls `Shell` makes of docker's API; its stream is one end of a socket pair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def exec_create(self, *args, **kwargs):
        return {"Id": "exec"}

    def exec_start(self, exec_id, socket=False):
        return self.sock


def _started_shell():
    ours, runner = socket.socketpair()
    runner.sendall(_frame(json.dumps({"ready": 1}).encode() + b"\n"))
    return Shell(_Api(ours), "container", "wrapper", {}, "/"), runner


def _read_request(runner: socket.socket, deadline_s: float = 30.0) -> dict:
    runner.settimeout(deadline_s)
    data = b""
    while b"\n" not in data:
        chunk = runner.recv(4096)
        assert chunk, "the client closed the stream before sending its request"
        data += chunk
    return json.loads(data.split(b"\n")[0])


def test_closing_under_a_waiting_command_wakes_it_and_leaves_the_descriptor_to_it():
    """Closing the runner from another thread (a sandbox closed by a stopping run) must wake the thread waiting
    for the command's answer, and must not release the stream's descriptor under it: a released descriptor is
    reused by the next socket the process opens, and the woken wait then waits on that one (seen: a command's
    thread waiting out its 300 s deadline on the client's next connection to the daemon)."""
    shell, runner = _started_shell()
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(shell.run, "sleep 300", 300.0, "/", {}, 1000, 5.0)
            assert _read_request(runner)["cmd"] == "sleep 300"  # the command is under way: its thread waits
            fd = shell._raw.fileno()
            shell.close()
            still_open = shell._raw.fileno()
            reused = [socket.socket() for _ in range(4)]  # what the process opens next (the daemon's API)
            try:
                answer = waiting.result(timeout=30)
            finally:
                for s in reused:
                    s.close()
        assert still_open == fd  # not released under the waiting thread
        assert answer.status is None and answer.died
        assert shell._raw.fileno() == -1  # released by that thread on its way out
        assert shell.alive is False
    finally:
        runner.close()


def test_closing_an_idle_runner_releases_its_descriptor_at_once():
    shell, runner = _started_shell()
    try:
        shell.close()
        assert shell._raw.fileno() == -1 and shell.alive is False
        shell.close()  # idempotent
        answer = shell.run("true", 10.0, "/", {}, 1000, 5.0)  # a closed runner answers at once, sends nothing
        assert answer.status is None and answer.died
    finally:
        runner.close()


def test_an_answer_is_read_back_through_the_stream():
    shell, runner = _started_shell()
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(shell.run, "echo hi", 10.0, "/", {}, 1000, 5.0)
            _read_request(runner)
            header = json.dumps({"exit": 3, "dropped": 0, "head": 3, "tail": 0}).encode() + b"\n"
            runner.sendall(_frame(b"noise", stream=2) + _frame(header + b"hi\n"))
            answer = pending.result(timeout=30)
        assert (answer.status, answer.head, answer.tail, answer.died) == (3, b"hi\n", b"", False)
        assert shell.alive
    finally:
        shell.close()
        runner.close()
