"""Where an agent's shell commands run: the `CommandRunner` seam, and a local-subprocess runner.

An agent needs one thing from its environment: run a bash command with a timeout and get back its exit
code and output. `CommandRunner` is that seam, as a structural Protocol: the Docker `Sandbox`
(`sandbox.py`, whose `exec(cmd, timeout_s, workdir)` returns an `ExecResult` with `exit_code`, `output`,
`timed_out` and `truncated`) satisfies it without importing anything from here, and so does `LocalRunner`.

`LocalRunner` runs commands with bash in a local checkout, as the sandbox does in a container: a fresh
shell per command (only the file system carries over), stderr merged into stdout, the output capped
(first and last halves kept), and the command's whole process group killed at the timeout and when the
command ends. It is for tests and for users without Docker, on tasks they trust: it is NOT isolation.
The commands run as you, with your network and your files; `cd /` reaches everything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from swebench_env.git import base_env

DEFAULT_OUTPUT_LIMIT_BYTES = 256 * 1024
READ_CHUNK_BYTES = 64 * 1024
DRAIN_TIMEOUT_S = 2.0  # after the command ends: wait this long for its output pipe to close


class CommandResult(Protocol):
    """What a command's run gives back (read-only): the Docker sandbox's `ExecResult` has these fields."""

    @property
    def exit_code(self) -> int: ...  # the command's status; -1 (local) or 137 (Docker) when killed

    @property
    def output(self) -> str: ...  # stdout and stderr merged, possibly truncated

    @property
    def timed_out(self) -> bool: ...

    @property
    def truncated(self) -> bool: ...  # the output was over the runner's limit; its middle was left out


class CommandRunner(Protocol):
    """Runs one bash command in a fresh shell; a failing or hanging command is a result, not an exception."""

    def exec(self, cmd: str, timeout_s: float, workdir: str | None = None) -> CommandResult:
        """Run `cmd` in `workdir` (None: the runner's own default, the task's checkout) for at most `timeout_s`."""
        ...


@dataclass(frozen=True)
class LocalResult:
    exit_code: int  # the command's status; -1 when it was killed at the timeout
    output: str  # stdout and stderr merged, decoded as UTF-8 (errors replaced)
    timed_out: bool
    truncated: bool = False  # over the output limit: the first and last halves are kept
    duration_s: float = 0.0


class LocalRunner:
    """Runs commands with `bash -c` in the folder `root` (see the module docstring: no isolation).

    `python` resolves to this interpreter, so commands use the packages it has (pytest); git reads no
    global or system configuration. `env` adds to (or overrides) the commands' environment."""

    def __init__(
        self,
        root: Path | str,
        output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"LocalRunner root {self.root} is not a folder")
        if output_limit_bytes < 64:
            raise ValueError(f"output_limit_bytes must be >= 64, got {output_limit_bytes}")
        self.output_limit_bytes = output_limit_bytes
        self.env = base_env({"PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})})
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', '')}"

    def exec(self, cmd: str, timeout_s: float, workdir: str | None = None) -> LocalResult:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be positive")
        cwd = self.root if workdir is None else self.root / workdir  # an absolute workdir replaces the root
        start = time.monotonic()
        proc = subprocess.Popen(
            ["bash", "-c", cmd],
            cwd=cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so everything it starts can be killed at once
        )
        capture = _Capture(self.output_limit_bytes)
        reader = threading.Thread(target=capture.read_all, args=(proc.stdout,), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # at the timeout, or stragglers it left running (`cmd &`) when it ended
            proc.wait()
            reader.join(DRAIN_TIMEOUT_S)  # a `setsid` child may hold the pipe open: stop waiting for it
        code = -1 if timed_out else proc.returncode
        return LocalResult(code, capture.text(), timed_out, capture.dropped > 0, time.monotonic() - start)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


class _Capture:
    """Keeps the first and last halves of a stream within `limit` bytes; counts what it drops."""

    def __init__(self, limit: int) -> None:
        self.half = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self._lock = threading.Lock()  # `text` may be read while a straggler still writes

    def read_all(self, stream) -> None:
        """Read until end of file, then close the pipe (here: a read blocked on it cannot be interrupted)."""
        with stream:
            while chunk := stream.read1(READ_CHUNK_BYTES):
                self.add(chunk)

    def add(self, data: bytes) -> None:
        with self._lock:
            room = self.half - len(self.head)
            if room > 0:
                self.head += data[:room]
                data = data[room:]
            self.tail += data
            if len(self.tail) > self.half:
                cut = len(self.tail) - self.half
                self.dropped += cut
                del self.tail[:cut]

    def text(self) -> str:
        with self._lock:
            marker = f"\n[... {self.dropped} bytes of output left out ...]\n".encode() if self.dropped else b""
            return bytes(self.head + marker + self.tail).decode("utf-8", errors="replace")
