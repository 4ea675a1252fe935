"""Shared fixtures for the runtime's tests: the default tokenizer, managers over fake engines, raw HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from reference.engine.fake import FakeEngine
from reference.manager.embedded import ManagerThread
from reference.manager.manager import ManagerConfig


@pytest.fixture(scope="session")
def tok():
    from reference.tokenizer import default_tokenizer

    return default_tokenizer()


@pytest.fixture
def fake_manager(tok, tmp_path):
    """`fake_manager(n_engines=1, store=None, **fake_kwargs)` -> (ManagerThread, [FakeEngine])."""
    opened: list[ManagerThread] = []

    def make(n_engines: int = 1, store=None, config: ManagerConfig | None = None, **fake_kwargs):
        fake_kwargs.setdefault("vocab_size", tok.vocab_size)
        engines = [FakeEngine(**fake_kwargs) for _ in range(n_engines)]
        m = ManagerThread(
            {f"fake-{i}": e for i, e in enumerate(engines)},
            tok,
            store or tmp_path / "trajectories.sqlite",
            config or ManagerConfig(default_max_tokens=64),
        )
        opened.append(m)
        return m, engines

    yield make
    for m in opened:
        m.close()


def _http(method: str, url: str, body: bytes | dict | None = None, timeout_s: float = 30.0,
          headers: dict | None = None) -> tuple[int, dict]:  # fmt: skip
    """(status, JSON body) of a raw HTTP call; error statuses are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@contextmanager
def _openai_client(base_url: str, timeout_s: float = 60.0):
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout_s)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def http():
    """`http(method, url, body=None)` -> (status, JSON body); error statuses are returned, not raised."""
    return _http


@pytest.fixture(scope="session")
def openai_client():
    """`with openai_client(base_url[, timeout_s]) as client:` the official client, no retries, 60 s a request by
    default."""
    return _openai_client


def _wait_for(condition, timeout_s: float = 60.0, what: str = "condition"):
    """condition()'s first truthy value, polled until a deadline (AssertionError naming `what` after it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="session")
def wait_for():
    """`wait_for(condition, timeout_s=60, what=...)`: wait on a condition with a deadline, never a fixed sleep."""
    return _wait_for
