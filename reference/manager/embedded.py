"""The trajectory manager in a background thread of a Python program (a trainer, a test, a benchmark).

    with ManagerThread(engines, tokenizer, "results/t.sqlite") as m:
        client = openai.OpenAI(base_url=m.base_url("episode-1"), api_key="none")
        ...
        m.call(m.manager.pause())   # run a coroutine on the manager's loop and wait for it

The engines given must be usable from the manager's loop: `HTTPEngine` clients of engine
processes (the real setup) or in-process fakes (tests). The manager's event loop never runs a model.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from reference.engine.base import InferenceEngine
from reference.engine.sockets import bound_port
from reference.manager.manager import ManagerConfig, TrajectoryManager
from reference.manager.server import start_manager_server
from reference.manager.store import TrajectoryStore
from reference.manager.supervisor import EngineHandle, SupervisorConfig


class ManagerThread:
    def __init__(
        self,
        engines: dict[str, InferenceEngine],
        tokenizer,
        store_path: str | Path | TrajectoryStore = ":memory:",
        config: ManagerConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = 60.0,
        processes: dict[str, EngineHandle] | None = None,
        supervisor: SupervisorConfig | None = None,
    ) -> None:
        """`store_path`: a path, or an open store (which `close()` then closes); `processes`: engine processes
        the manager may restart (see supervisor.py)."""
        self.store = store_path if isinstance(store_path, TrajectoryStore) else TrajectoryStore(store_path)
        self.manager = TrajectoryManager(
            engines, tokenizer, self.store, config or ManagerConfig(), processes=processes, supervisor=supervisor
        )
        self.host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trajectory-manager", daemon=True)
        self._thread.start()
        try:
            self._runner = self.call(start_manager_server(self.manager, host, port), timeout_s=start_timeout_s)
        except BaseException:
            self._stop_loop()
            self.store.close()
            raise
        self.port = bound_port(self._runner)
        self.url = f"http://{host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        """The OpenAI base URL an agent uses for one session."""
        return f"{self.url}/s/{session_id}/v1"

    def call(self, coro: Coroutine, timeout_s: float | None = 600.0) -> Any:
        """Run a coroutine on the manager's loop from another thread and wait for its result."""
        future: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except BaseException:  # timed out or interrupted: the coroutine must not run on unattended
            future.cancel()
            raise

    def call_soon(self, fn, *args) -> Any:
        """Run a plain function on the manager's loop thread (where its state may be touched) and wait."""

        async def run():
            return fn(*args)

        return self.call(run(), timeout_s=60.0)

    def submit(self, coro: Coroutine) -> Future:
        """Run a coroutine on the manager's loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _stop_loop(self) -> None:
        try:
            self.call(self._loop.shutdown_default_executor(), timeout_s=30)  # the to_thread workers
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.call(self._runner.cleanup(), timeout_s=30)
            for engine in self.manager.engines.values():
                close = getattr(engine, "aclose", None) or getattr(engine, "close", None)
                if close is not None and asyncio.iscoroutinefunction(close):
                    self.call(close(), timeout_s=10)
        finally:
            self._stop_loop()
            self.store.close()

    def __enter__(self) -> ManagerThread:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
