"""Engine authentication: with a token, every endpoint but /health answers 401 to a caller without it;
`HTTPEngine` sends it; where the token comes from; no unauthenticated engine off loopback."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from reference.engine.auth import TOKEN_ENV, TOKEN_FILE_ENV, is_loopback, token_from_env
from reference.engine.base import EngineError, GenerateRequest, SamplingParams, generate
from reference.engine.client import HTTPEngine
from reference.engine.fake import FakeEngine
from reference.engine.process import EngineSpec, serve_engine
from reference.engine.server import build_app, start_engine_server
from reference.engine.sockets import bound_port

TOKEN = "s3cret-token"
ENDPOINTS = [
    ("POST", "/generate", {"request_id": "r", "prompt_token_ids": [1], "params": {"max_tokens": 2}}),
    (
        "POST",
        "/generate_many",
        {"requests": [{"request_id": "m", "prompt_token_ids": [1], "params": {"max_tokens": 2}}]},
    ),
    ("POST", "/pause", {}),
    ("POST", "/update_weights", {"version": 1, "source": None}),
    ("POST", "/resume", {}),
    ("POST", "/abort", {"request_id": "r"}),
    ("GET", "/stats", None),
    ("GET", "/no-such-endpoint", None),
]


async def _statuses(headers: dict[str, str]) -> dict[str, tuple[int, str]]:
    """(status, body) of each endpoint of a token-protected engine, called with `headers`."""
    runner = await start_engine_server(FakeEngine(), token=TOKEN)
    out = {}
    try:
        async with aiohttp.ClientSession() as http:
            for method, path, body in [*ENDPOINTS, ("GET", "/health", None)]:
                url = f"http://127.0.0.1:{bound_port(runner)}{path}"
                async with http.request(method, url, json=body, headers=headers) as r:
                    out[path] = r.status, await r.text()
    finally:
        await runner.cleanup()
    return out


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                     {"Authorization": f"Basic {TOKEN}"}])  # fmt: skip
def test_without_the_token_every_endpoint_but_health_is_a_401(headers):
    statuses = asyncio.run(_statuses(headers))
    assert statuses.pop("/health")[0] == 200
    for path, (status, body) in statuses.items():
        assert status == 401, path
        assert "Bearer" in json.loads(body)["error"], path


def test_with_the_token_every_endpoint_answers():
    statuses = asyncio.run(_statuses({"Authorization": f"Bearer {TOKEN}"}))
    assert statuses.pop("/no-such-endpoint")[0] == 404
    assert {path: status for path, (status, _) in statuses.items()} == {path: 200 for path in statuses}


async def _raw_status(header_value: bytes) -> bytes:
    """The status line of GET /stats with `Authorization: <header_value>`, sent as raw bytes."""
    runner = await start_engine_server(FakeEngine(), token=TOKEN)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner))
        writer.write(
            b"GET /stats HTTP/1.1\r\nHost: x\r\nAuthorization: " + header_value + b"\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        status_line = await reader.readline()
        writer.close()
        await writer.wait_closed()
    finally:
        await runner.cleanup()
    return status_line


@pytest.mark.parametrize(
    "value", [b"Bearer \xff\xfe", "Bearer s3cret-tokén".encode(), b"Bearer " + TOKEN.encode() + b"\x80"]
)
def test_a_non_ascii_authorization_header_is_a_401_not_a_500(value):
    assert asyncio.run(_raw_status(value)).split()[1] == b"401"


async def _client_calls(token: str | None) -> list:
    """What an HTTPEngine holding `token` gets from a protected engine: generate, stats, pause, health."""
    runner = await start_engine_server(FakeEngine(), token=TOKEN)
    client = HTTPEngine(f"http://127.0.0.1:{bound_port(runner)}", token=token)
    outcomes: list = []
    calls = [
        lambda: generate(client, GenerateRequest("r", (1, 2), SamplingParams(max_tokens=3))),
        client.stats,
        client.pause,
        client.health,
    ]
    try:
        for call in calls:
            try:
                outcomes.append(await call())
            except EngineError as e:
                outcomes.append(e)
    finally:
        await client.close()
        await runner.cleanup()
    return outcomes


def test_http_engine_sends_its_token():
    result, stats, paused, healthy = asyncio.run(_client_calls(TOKEN))
    assert len(result.token_ids) == 3
    assert stats.running == 0
    assert paused is None
    assert healthy is True


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_refused_token_is_an_engine_error(token):
    *refused, healthy = asyncio.run(_client_calls(token))
    for outcome in refused:
        assert isinstance(outcome, EngineError)
        assert "refused the token" in str(outcome)
    assert healthy is True  # /health needs no token


@pytest.mark.parametrize("bad", ["", "two words", "tab\there", "naïve", "line\nbreak"])
def test_a_token_that_cannot_travel_in_a_header_is_refused_without_repeating_it(bad):
    for make in (lambda: HTTPEngine("http://127.0.0.1:9", token=bad), lambda: build_app(FakeEngine(), token=bad)):
        with pytest.raises(ValueError, match="printable ASCII without spaces") as info:
            make()
        assert not bad or bad not in str(info.value)


def test_the_token_comes_from_the_environment_or_a_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-file\n")
    assert token_from_env({}) is None
    assert token_from_env({TOKEN_ENV: "from-env"}) == "from-env"
    assert token_from_env({TOKEN_FILE_ENV: str(path)}) == "from-file"
    assert token_from_env({TOKEN_ENV: "from-env", TOKEN_FILE_ENV: str(path)}) == "from-env"
    with pytest.raises(ValueError, match="cannot read the engine token file"):
        token_from_env({TOKEN_FILE_ENV: str(tmp_path / "missing")})


@pytest.mark.parametrize("host", ["0.0.0.0", "", "10.1.2.3", "::", "engine.example.com"])
def test_an_engine_without_a_token_refuses_a_non_loopback_host(host, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match=f"non-loopback host {host!r} without a token"):
        asyncio.run(serve_engine(EngineSpec(backend="fake"), host, 0))


def test_loopback_hosts():
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.0.0.2")] == [True] * 4
    assert [is_loopback(h) for h in ("0.0.0.0", "", "::", "10.0.0.1", "localhost.evil.com")] == [False] * 5
