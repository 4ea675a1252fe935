"""What the runtime benchmarks share: server processes, core pinning, CPU accounting, percentiles.

A server under test (the trajectory manager, or the anchor proxy of `benchmarks/anchor_proxy.py`) runs
as its own process, so its CPU time is read from `/proc/<pid>/stat` (user + system, every thread).
Engines started by `EngineProcess` may carry a per-run secret (`EngineProcess.token`, newer
versions); when they do it is sent as a bearer token on direct calls and handed to the proxies in
`$SEAMLESSFLOW_ENGINE_TOKEN`, so the benchmarks run before and after that change.
"""

from __future__ import annotations

import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from core.cli import run_main, stop_on_sigterm

MODEL = "seamlessflow-tiny"
ENGINE_TOKEN_ENV = "SEAMLESSFLOW_ENGINE_TOKEN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_token(engine) -> str | None:
    """The engine process's per-run secret, or None where engines have none (older versions)."""
    return getattr(engine, "token", None)


def engine_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _stat_cpu_s(stat: str) -> float:
    """User + system CPU seconds from a /proc stat file."""
    with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (Linux)."""
    return _stat_cpu_s(f"/proc/{pid}/stat")


def run_queue_wait_s(pid: int) -> float:
    """Seconds the process's main thread has spent runnable but waiting for a core (Linux schedstat):
    a server that is neither running nor waiting here was idle; one that waits long was starved by
    other work on its core."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds of a process's main thread: its event loop. The rest of `cpu_s` is worker threads,
    those that ended included (the manager's SQLite writes, large bodies)."""
    return _stat_cpu_s(f"/proc/{pid}/task/{pid}/stat")


def pct(values: Sequence[float], q: int) -> float:
    """The q-th percentile (inclusive method); nan for no values."""
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def conversation(session: int, turn: int, output_words: int = 0) -> list[dict]:
    """Turn `turn` of an agent session: a system prompt, `turn` earlier exchanges, a new user message. With
    `output_words`, every user message also carries that many words (a task's files, a tool's output, as an
    agent's observations do), different in every session and step."""
    messages = [{"role": "system", "content": "You are a coding agent."}]

    def user(k: int, text: str) -> dict:
        if output_words:
            text += "\n" + " ".join(f"w{(session * 7919 + k * 104729 + j * 31) % 4093}" for j in range(output_words))
        return {"role": "user", "content": text}

    for k in range(turn):
        messages += [
            user(k, f"session {session} step {k}: run the tests and report"),
            {"role": "assistant", "content": f"ran step {k}"},
        ]
    return [*messages, user(turn, f"session {session} step {turn}: what next?")]


def listen_drops() -> int:
    """Connection attempts this machine's kernel dropped because a listen queue was full (TcpExt
    ListenDrops, every socket on the machine): each costs its client a SYN retry a second later."""
    try:
        with open("/proc/net/netstat") as f:
            lines = [line.split() for line in f if line.startswith("TcpExt:")]
        return int(dict(zip(lines[0], lines[1], strict=True))["ListenDrops"])
    except (OSError, IndexError, KeyError, ValueError):
        return 0


@contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Processes started inside write their stderr to `path` (for children whose stderr cannot be set)."""
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def raise_fd_limit() -> None:
    """Open-loop overload holds thousands of sockets; children inherit the raised soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 16, hard))


def core_plan(roles: int) -> list[set[int] | None]:
    """One core per role where the machine allows (the last roles share the last core); None: no pinning."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return [None] * roles
    return [{cores[min(i, len(cores) - 1)]} for i in range(roles)]


@contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Run the block on `cpus`: processes started inside inherit the affinity (with all their later
    threads). Only the calling thread's affinity changes, and it is restored after."""
    if cpus is None:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def run_benchmark(main: Callable[[], object]) -> None:
    """A benchmark's entry point: SIGTERM (`kill`, `timeout`, a batch scheduler) and Ctrl-C stop it with one line
    and exit code 143 or 130 once its `finally` blocks have run, so the servers and processes it started stop too
    (SIGTERM's default ends the process at once and leaves them running)."""
    with stop_on_sigterm():
        code = run_main(lambda: main() or 0)
    sys.exit(code)


class ServerProcess:
    """A server started as `python -m ...` on a free port; `close()` stops it (SIGTERM, then SIGKILL)."""

    def __init__(
        self, name: str, argv: list[str], port: int, env: dict[str, str], log: Path, cwd: Path | None = None
    ) -> None:
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env, cwd=cwd)
        try:
            self._wait_listening(60.0)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_s(self) -> float:
        return cpu_s(self.proc.pid)

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not listen on port {self.port} within {timeout_s} s")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _env(token: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if token:
        env[ENGINE_TOKEN_ENV] = token
    return env


def _python(profile: Path | None) -> list[str]:
    """The interpreter, under cProfile (which writes `profile` when the process exits) if asked."""
    return [sys.executable, "-m", "cProfile", "-o", str(profile)] if profile else [sys.executable]


def start_manager(
    engine_url: str,
    workdir: Path,
    token: str | None,
    extra: Sequence[str] = (),
    profile: Path | None = None,
    source: Path | None = None,
) -> ServerProcess:
    """`python -m reference serve --engine-url ...` with a fresh store in `workdir`; `source`: another checkout
    to run the manager from (the one a change started from, say), else this one."""
    port = free_port()
    tag = f"manager-{port}"
    # the benchmarks read /stats: no control token (a version that generates one by default can be told not to)
    quiet = ["--no-admin-token"] if serve_has_flag("--no-admin-token") else []
    argv = [
        *_python(profile),
        "-m",
        "reference",
        "serve",
        "--engine-url",
        engine_url,
        "--port",
        str(port),
        "--store",
        str(workdir / f"{tag}.sqlite"),
        *quiet,
        *extra,
    ]
    env = _env(token) | ({"PYTHONPATH": str(source.resolve())} if source is not None else {})
    cwd = source.resolve() if source is not None else None  # `-m` puts the working directory first on the path
    return ServerProcess("the trajectory manager", argv, port, env, workdir / f"{tag}.log", cwd)


def start_anchor(engine_url: str, workdir: Path, token: str | None, profile: Path | None = None) -> ServerProcess:
    """The minimal OpenAI proxy (`benchmarks/anchor_proxy.py`) in front of the same engine."""
    port = free_port()
    argv = [*_python(profile), "-m", "benchmarks.anchor_proxy", "--engine-url", engine_url, "--port", str(port)]
    return ServerProcess("the anchor proxy", argv, port, _env(token), workdir / f"anchor-{port}.log")


@cache
def serve_help() -> str:
    """`python -m reference serve --help`, to learn which flags this version of the manager has."""
    out = subprocess.run(
        [sys.executable, "-m", "reference", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    return out.stdout


def serve_has_flag(flag: str) -> bool:
    return re.search(rf"{re.escape(flag)}(?![\w-])", serve_help()) is not None
