"""A command runner that lives in a sandbox: one `docker exec` for all of an agent's commands.

Each `Sandbox.exec` is a `docker exec`: the daemon, containerd and `runc` start a process in the
container's namespaces, about 80 ms of CPU (measured: 70 ms daemon side, 9 ms in this client), as much as
a short command itself. An agent runs a dozen commands an episode, and a training run thousands of
episodes. `Shell` starts one small Python process in the container (`RUNNER`, standard library only,
Python 3.5 or later) with its stdin attached; each command is then a line sent to it and an answer read
back, and the runner starts the command exactly as `exec` would: `sh -c WRAPPER <timeout> <cmd>` (its own
process group, killed at the timeout, whatever it left running killed when it ends), in the asked folder,
with the container's environment plus the asked variables, no stdin, stderr merged into stdout, at most
`output_limit_bytes` kept (first and last halves), waiting for the command's main process and not for
something it started with `setsid`. Results are the same `ExecResult`s.

The protocol, on the runner's stdin and stdout: a request is one JSON line (`cmd`, `timeout`, `workdir`,
`env`, `limit`); an answer is one JSON line (`exit`, `dropped`, `head`, `tail`: byte counts) followed by
that many bytes of output. The runner first writes `{"ready": 1}`.

Falling back: `Sandbox.exec` uses plain `docker exec` when the runner could not start (no `python3` in
the image: `available` is False), while another thread is using it, and for good once it has died (a
command killed it: `kill -9 -1`, `pkill python3`); the command it was running then gets exit status -1 and
an output saying what happened. A runner that does not answer by the command's timeout plus the client's
grace is treated the same way, as a timed-out command. A command runs as root beside the runner and can write
to the runner's own stdout: an answer that is malformed, longer than the output limit, or a header past
`MAX_LINE_BYTES` ends the runner the same way, so a forged answer can only fake that command's own output
(which it writes anyway), never make the client read or buffer without bound.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from swebench_env.exec_stream import close_socket

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 4096  # an answer's JSON header; more without a newline is not the runner's
READY_TIMEOUT_S = 20.0  # the runner's start: a `docker exec` and a Python start
RUNNER_DIED = (
    "[the sandbox's command runner ended while this command ran (did the command kill it?); its status is unknown]"
)

# Python 3.5-compatible (SWE-bench's images carry old Pythons): no f-strings. argv[1] is the wrapper.
RUNNER = r"""
import json, os, select, subprocess, sys
wrapper = sys.argv[1]
out, inp = sys.stdout.buffer, sys.stdin.buffer
def send(obj, payload=b""):
    out.write(json.dumps(obj).encode() + b"\n" + payload)
    out.flush()
send({"ready": 1})
while True:
    line = inp.readline()
    if not line:
        break
    req = json.loads(line.decode())
    env = dict(os.environ)
    env.update(req["env"])
    env["PWD"] = req["workdir"]
    half = req["limit"] // 2
    rest = req["limit"] - half
    head, tail, dropped = bytearray(), bytearray(), 0
    try:
        p = subprocess.Popen(["sh", "-c", wrapper, req["timeout"], req["cmd"]], cwd=req["workdir"], env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        msg = ("cannot run the command in " + req["workdir"] + ": " + str(e) + "\n").encode()
        send({"exit": 126, "dropped": 0, "head": len(msg), "tail": 0}, msg)
        continue
    fd = p.stdout.fileno()
    while True:
        ready = select.select([fd], [], [], 0.2)[0]
        if not ready:
            if p.poll() is not None:
                break  # ended; something it started (setsid) holds the output open
            continue
        data = os.read(fd, 65536)
        if not data:
            break
        room = half - len(head)
        if room > 0:
            head += data[:room]
            data = data[room:]
        tail += data
        if len(tail) > 2 * rest:
            dropped += len(tail) - rest
            del tail[:len(tail) - rest]
    status = p.wait()
    p.stdout.close()
    if len(tail) > rest:
        dropped += len(tail) - rest
        del tail[:len(tail) - rest]
    send({"exit": status if status >= 0 else 128 - status, "dropped": dropped, "head": len(head),
          "tail": len(tail)}, bytes(head) + bytes(tail))
"""


class ShellError(RuntimeError):
    """The runner could not start, or ended."""


class _TimedOut(ShellError):
    pass


@dataclass(frozen=True)
class Answer:
    status: int | None  # the command's exit status; None: no answer (see `died`)
    head: bytes  # the output's first half (all of it when nothing was dropped)
    tail: bytes  # its last half
    dropped: int  # bytes left out between them
    died: bool  # the runner ended while the command ran (else, with no status: it did not answer in time)


class Shell:
    """The command runner of one started sandbox (`Sandbox.start_shell()` makes it)."""

    def __init__(self, api, container_id: str, wrapper: str, env: Mapping[str, str], workdir: str) -> None:
        self._close_socket = close_socket
        self.lock = threading.Lock()  # held while a command runs
        self.alive = False
        self._state = threading.Lock()  # guards `alive`, `_busy` and the descriptor's release
        self._busy = False  # a thread is in `run`: it releases the descriptor, not `close`
        self._released = False
        try:
            exec_id = api.exec_create(
                container_id, ["python3", "-c", RUNNER, wrapper], stdin=True, workdir=workdir, environment=dict(env)
            )["Id"]
            self._sock = api.exec_start(exec_id, socket=True)
        except Exception as e:
            raise ShellError(f"could not start the command runner: {e}") from e
        self._raw = getattr(self._sock, "_sock", self._sock)
        self._frames = bytearray()
        self._stdout = bytearray()
        self._stderr = bytearray()
        try:
            ready = self._read_line(time.monotonic() + READY_TIMEOUT_S)
            if json.loads(ready) != {"ready": 1}:
                raise ShellError(f"the command runner said {ready[:200]!r}")
        except (ShellError, ValueError) as e:
            self.close()
            why = self._stderr.decode(errors="replace").strip()[-300:]
            raise ShellError(f"the command runner did not start: {why or e}") from e
        self.alive = True

    def run(
        self, cmd: str, timeout_s: float, workdir: str, env: Mapping[str, str], limit: int, grace_s: float
    ) -> Answer:
        """Run `cmd` as `Sandbox.exec` would. With no answer by `timeout_s + grace_s`, or once the runner has
        ended, the runner is closed (`alive` False) and the answer's `status` is None."""
        request = {"cmd": cmd, "timeout": f"{timeout_s:.3f}", "workdir": workdir, "env": dict(env), "limit": limit}
        deadline = time.monotonic() + timeout_s + grace_s
        with self._state:
            if not self.alive:
                return Answer(None, RUNNER_DIED.encode(), b"", 0, died=True)
            self._busy = True
        try:
            return self._run(request, deadline, limit)
        finally:
            with self._state:
                self._busy = False
                if not self.alive:
                    self._release()

    def _run(self, request: dict, deadline: float, limit: int) -> Answer:
        try:
            self._raw.sendall(json.dumps(request).encode() + b"\n")
            answer = json.loads(self._read_line(deadline))
            split, size = int(answer["head"]), int(answer["head"]) + int(answer["tail"])
            if not (0 <= split <= size <= limit):  # a command writing to the runner's own stdout forges answers
                raise ShellError(f"the command runner's answer is malformed: {str(answer)[:200]}")
            body = self._read_bytes(size, deadline)
            status, dropped = int(answer["exit"]), int(answer["dropped"])
        except _TimedOut:
            self.close()
            return Answer(None, b"", b"", 0, died=False)
        except (ShellError, OSError, ValueError, KeyError, TypeError) as e:
            log.info("the command runner ended (%s); commands go through docker exec from now on", e)
            self.close()
            return Answer(None, RUNNER_DIED.encode(), b"", 0, died=True)
        return Answer(status, body[:split], body[split:], dropped, died=False)

    def close(self) -> None:
        """End the stream. A thread waiting in `run` (the sandbox closed under a running command, as a
        stopping run closes them) wakes at once: shutting the socket down wakes its `select`. The descriptor
        itself is released by that thread on its way out, never under it: a descriptor closed while another
        thread selects on it can be reused at once (the client's next connection to the daemon), and the
        woken `select` then waits on that connection until the command's deadline."""
        with self._state:
            self.alive = False
            try:
                self._raw.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed, or never connected
                pass
            if not self._busy:
                self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._close_socket(self._sock)

    # -- the stream: Docker frames its stdout (1) and stderr (2) as 8-byte headers and payloads --------------

    def _read_line(self, deadline: float) -> str:
        while (end := self._stdout.find(b"\n")) < 0:
            if len(self._stdout) > MAX_LINE_BYTES:  # an answer's header is short: not the runner writing
                raise ShellError("the command runner wrote a line past its size")
            self._fill(deadline)
        line = bytes(self._stdout[:end])
        del self._stdout[: end + 1]
        return line.decode()

    def _read_bytes(self, n: int, deadline: float) -> bytes:
        while len(self._stdout) < n:
            self._fill(deadline)
        data = bytes(self._stdout[:n])
        del self._stdout[:n]
        return data

    def _fill(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self._raw], [], [], left)[0]:
            raise _TimedOut("the command runner did not answer in time")
        try:
            data = self._raw.recv(65536)
        except OSError as e:
            raise ShellError(f"the command runner's stream failed: {e}") from e
        if not data:
            raise ShellError("the command runner ended")
        self._frames += data
        while len(self._frames) >= 8:
            size = int.from_bytes(self._frames[4:8], "big")
            if len(self._frames) < 8 + size:
                break
            (self._stdout if self._frames[0] == 1 else self._stderr).extend(self._frames[8 : 8 + size])
            del self._frames[: 8 + size]
        if len(self._stderr) > 65536:
            del self._stderr[:-4096]
