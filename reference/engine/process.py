"""Engines in their own processes: one per resource, each an HTTP server (reference/engine/server.py).

`EngineProcess` starts `python -m reference engine --spec-json SPEC` (its `EngineSpec`, reference/engine/backends.py,
as one JSON document) with a fresh secret token in its environment (never on its command line), waits for the line
that announces its port, and hands back an `HTTPEngine` that sends the token. The child is killed on `close()` (and
replaced on `restart()`), and dies with the parent's stdin pipe if the parent is killed without closing it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import queue
import signal
import subprocess
import sys
import threading

from reference.engine.auth import (
    MANAGER_TOKEN_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    check_token,
    new_token,
    require_token_off_loopback,
    token_from_env,
)
from reference.engine.backends import EngineSpec, engine_factory
from reference.engine.base import InferenceEngine
from reference.engine.client import HTTPEngine

READY_PREFIX = "ENGINE READY port="
__all__ = ["EngineProcess", "EngineSpec", "engine_argv", "make_engine", "serve_engine"]


def engine_argv(spec: EngineSpec, host: str, port: int) -> list[str]:
    """The engine process's command line: the spec as one JSON document (no secret in it: the token travels in
    the environment)."""
    return [
        sys.executable,
        "-m",
        "reference",
        "engine",
        "--host",
        host,
        "--port",
        str(port),
        "--spec-json",
        spec.to_json(),
        "--watch-stdin",
    ]


def make_engine(spec: EngineSpec) -> InferenceEngine:
    """Build the in-process engine a spec names (called inside the engine process): its backend's factory."""
    return engine_factory(spec.backend)(spec)


class EngineProcess:
    """One engine in a child process, reachable only with its token. Use as a context manager or call
    `close()`; `restart()` replaces a dead or hung child with a fresh one (same spec, same token)."""

    def __init__(
        self,
        spec: EngineSpec,
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = 300.0,
        *,
        token: str | None = None,
    ) -> None:
        """`token`: the bearer token the engine will demand; a fresh secret when None."""
        self.spec, self.host, self._requested_port = spec, host, port
        self._token = new_token() if token is None else check_token(token)
        self._start(start_timeout_s)

    @property
    def token(self) -> str:
        return self._token

    def _start(self, timeout_s: float) -> None:
        env = {**os.environ, TOKEN_ENV: self._token}
        env.pop(TOKEN_FILE_ENV, None)
        env.pop(MANAGER_TOKEN_ENV, None)  # an engine gets its own token only, not the one that changes training
        self._proc = subprocess.Popen(
            engine_argv(self.spec, self.host, self._requested_port),
            stdin=subprocess.PIPE,  # the child exits when this pipe closes (parent gone)
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        ready: queue.Queue[int | None] = queue.Queue()
        # Reads the READY line, then keeps draining the child's stdout so it never blocks on a full pipe.
        threading.Thread(target=_watch_stdout, args=(self._proc, ready), daemon=True).start()
        try:
            self.port = self._wait_ready(ready, timeout_s)
        except BaseException:  # Ctrl-C while the engine loads, too: the child must not outlive its start
            self.kill()
            self._close_stdin()
            raise
        self.url = f"http://{_url_host(self.host)}:{self.port}"

    def _wait_ready(self, ready: queue.Queue, timeout_s: float) -> int:
        try:
            port = ready.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            self._close_stdin()
            raise TimeoutError(f"engine process did not start within {timeout_s} s") from None
        if port is None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
            self._close_stdin()
            code = self._proc.returncode
            raise RuntimeError(f"engine process ({self.spec.backend}, {self.spec.model}) exited with {code}")
        return port

    def restart(self, start_timeout_s: float = 300.0) -> None:
        """Kill the child (if alive) and start a new one with the same spec and token; blocks until it is
        ready, then `port` and `url` name the new child (clients must be pointed at the new `url`)."""
        self.kill()
        self._close_stdin()
        self._start(start_timeout_s)

    def client(self, stall_timeout_s: float = 60.0) -> HTTPEngine:
        return HTTPEngine(self.url, token=self._token, stall_timeout_s=stall_timeout_s)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        """Kill the engine abruptly (SIGKILL to its process group), as a crash would."""
        if self.alive():
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)

    def close(self) -> None:
        if self.alive():
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_stdin()

    def _close_stdin(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _watch_stdout(proc: subprocess.Popen, ready: queue.Queue) -> None:
    """Put the port of `proc`'s READY line on `ready` (None if its stdout ends first); drain the rest."""
    announced = False
    for line in proc.stdout or ():
        if not announced and line.startswith(READY_PREFIX) and line[len(READY_PREFIX) :].strip().isdigit():
            ready.put(int(line[len(READY_PREFIX) :]))
            announced = True
    if not announced:
        ready.put(None)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def stop_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """A future that gets the first SIGINT or SIGTERM: a server shuts down gracefully on it (and tells the
    one from the other: Ctrl-C exits with 130, a stop request with 0) instead of being interrupted."""
    stopped = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: stopped.done() or stopped.set_result(sig))
    return stopped


async def serve_engine(
    spec: EngineSpec, host: str, port: int, watch_stdin: bool = False, token: str | None = None
) -> signal.Signals:
    """The engine process's main: serve until SIGTERM/SIGINT (returned), or until stdin closes with
    `watch_stdin`. `token` (default: from $SEAMLESSFLOW_ENGINE_TOKEN or $SEAMLESSFLOW_ENGINE_TOKEN_FILE) is
    demanded of every caller; without one, only a loopback `host` is allowed (ValueError otherwise). The
    port is bound before the model loads, so a port in use is a UserError at once."""
    from reference.engine.server import start_engine_server
    from reference.engine.sockets import bound_port, listen_sockets

    token = token_from_env() if token is None else check_token(token)
    require_token_off_loopback(host, token)
    sockets = listen_sockets(host, port)
    try:
        engine = make_engine(spec)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    runner = await start_engine_server(
        engine, heartbeat_s=spec.heartbeat_s, coalesce_s=spec.coalesce_s, token=token, sockets=sockets
    )
    print(f"{READY_PREFIX}{bound_port(runner)}", flush=True)
    loop = asyncio.get_running_loop()
    stopped = stop_signals(loop)
    orphaned = asyncio.Event()
    if watch_stdin:
        loop.add_reader(sys.stdin.fileno(), lambda: orphaned.set() if not os.read(sys.stdin.fileno(), 1) else None)
    try:
        await asyncio.wait([stopped, asyncio.ensure_future(orphaned.wait())], return_when=asyncio.FIRST_COMPLETED)
        if orphaned.is_set():
            # The parent is gone: nobody will read what is in flight, and a graceful drain would hold open
            # streams (paused ones for ever) so that clients could not fail over. Exit at once.
            print("engine: parent process gone, exiting", file=sys.stderr, flush=True)
            os._exit(1)
    finally:
        await runner.cleanup()
        close = getattr(engine, "close", None) or getattr(engine, "shutdown", None)
        if close is not None and inspect.isawaitable(result := close()):
            await result
    return stopped.result()
