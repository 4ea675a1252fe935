"""`HTTPEngine`: the `InferenceEngine` protocol over HTTP, reaching an engine in another process.

A connection failure, a dropped stream, a 5xx or a refused token (401) becomes `EngineError` (the
manager retries the request elsewhere); a 400 becomes `ValueError` with the engine's message (the
agent's fault). Closing a stream early closes the HTTP response, which makes the engine abort the
request. `base_url` may be reassigned (an engine restarted on another port); every call reads it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing

import aiohttp

from reference.engine.auth import bearer_headers, check_token
from reference.engine.base import (
    EngineError,
    EngineStats,
    Finished,
    FinishReason,
    GenerateRequest,
    TokenBatch,
    TokenEvent,
)
from reference.engine.server import request_to_wire


class HTTPEngine:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        connect_timeout_s: float = 5.0,
        control_timeout_s: float = 600.0,
        stall_timeout_s: float = 60.0,
    ) -> None:
        """`token`: the engine's bearer token (sent on every call but `health`). `stall_timeout_s`: a
        stream that sends nothing, not even the server's heartbeat, for this long is an engine failure
        (a hung or frozen process)."""
        self.base_url = base_url
        self._headers = bearer_headers(None if token is None else check_token(token))
        self.stall_timeout_s = stall_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.control_timeout_s = control_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"HTTPEngine({self.base_url!r})"

    @property
    def base_url(self) -> str:
        return self._base_url

    @base_url.setter
    def base_url(self, url: str) -> None:
        self._base_url = url.rstrip("/")

    def _refused(self, path: str) -> EngineError:
        return EngineError(f"engine {self.base_url} refused the token on {path} (HTTP 401)")

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0)  # one stream per in-flight request, no pool cap
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | Finished]:
        async with aclosing(self.stream_batches(request)) as batches:
            async for item in batches:
                if isinstance(item, Finished):
                    yield item
                    return
                for t, lp, v in zip(item.token_ids, item.logprobs, item.versions, strict=True):
                    yield TokenEvent(t, lp, v)

    async def stream_batches(self, request: GenerateRequest) -> AsyncIterator[TokenBatch | Finished]:
        """`stream`, one `TokenBatch` per line the engine sent."""
        # No total timeout: a generation may legitimately wait out a long pause for a weight update;
        # the server's heartbeat keeps the read timeout from firing meanwhile.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=self.stall_timeout_s)
        try:
            async with self._http().post(
                f"{self.base_url}/generate", json=request_to_wire(request), headers=self._headers, timeout=timeout
            ) as response:
                if response.status == 401:
                    raise self._refused("/generate")
                if response.status == 400:
                    raise ValueError((await response.json()).get("error", "bad request"))
                if response.status != 200:
                    raise EngineError(f"{self.base_url}: HTTP {response.status}: {await response.text()}")
                async for raw in response.content:
                    item = _parse_line(raw, self.base_url)
                    if isinstance(item, Finished):
                        # The server ends the body right after the finish line: reading that end lets the
                        # connection go back to the pool (an unread end closes it: a new TCP connection a call).
                        await response.content.read()
                        yield item
                        return
                    if item is not None:  # None: a heartbeat
                        yield item
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as e:
            raise EngineError(f"{self.base_url}: {type(e).__name__}: {e}") from e
        raise EngineError(f"{self.base_url}: stream for {request.request_id} ended without a finish line")

    async def _post(self, path: str, body: dict | None = None) -> dict:
        timeout = aiohttp.ClientTimeout(total=self.control_timeout_s, sock_connect=self.connect_timeout_s)
        try:
            url = f"{self.base_url}{path}"
            async with self._http().post(url, json=body or {}, headers=self._headers, timeout=timeout) as response:
                if response.status == 401:
                    raise self._refused(path)
                data = await response.json()
                if response.status == 409:
                    raise RuntimeError(data.get("error"))
                if response.status == 400:
                    raise ValueError(data.get("error"))
                if response.status != 200:
                    raise EngineError(f"{self.base_url}{path}: HTTP {response.status}: {data}")
                return data
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as e:
            raise EngineError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from e

    async def pause(self) -> None:
        await self._post("/pause")

    async def update_weights(self, version: int, source: str | None = None) -> None:
        await self._post("/update_weights", {"version": version, "source": source})

    async def resume(self) -> None:
        await self._post("/resume")

    async def abort(self, request_id: str) -> None:
        await self._post("/abort", {"request_id": request_id})

    async def abort_many(self, request_ids: list[str]) -> None:
        """Abort several requests in one round trip."""
        await self._post("/abort", {"request_ids": request_ids})

    async def _get(self, path: str) -> dict:
        timeout = aiohttp.ClientTimeout(total=self.control_timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._http().get(f"{self.base_url}{path}", headers=self._headers, timeout=timeout) as response:
                if response.status == 401:
                    raise self._refused(path)
                data = await response.json()
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as e:
            raise EngineError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
        if response.status != 200:
            raise EngineError(f"{self.base_url}{path}: HTTP {response.status}: {data}")
        return data

    async def health(self, timeout_s: float = 2.0) -> bool:
        """Whether the engine answers `GET /health` within `timeout_s`; False on any failure."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._http().get(f"{self.base_url}/health", timeout=timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return False

    async def timeline(self) -> dict:
        """The engine's activity log (`GET /timeline`): {"now_s", "intervals": [...]}."""
        return await self._get("/timeline")

    async def stats(self) -> EngineStats:
        d = await self._get("/stats")
        return EngineStats(d["running"], d["waiting"], d["version"], d["paused"], d["max_context"], d.get("extra", {}))


def _parse_line(raw: bytes, where: str) -> TokenBatch | Finished | None:
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise EngineError(f"{where}: unreadable stream line {raw[:80]!r}") from e
    if not isinstance(d, dict):
        raise EngineError(f"{where}: a stream line that is not an object: {raw[:80]!r}")
    if "t" in d:
        ids, logprobs, versions = d["t"], d.get("l"), d.get("v")
        if not isinstance(ids, list):
            ids, logprobs, versions = [ids], [logprobs], [versions]
        if not (
            isinstance(logprobs, list) and isinstance(versions, list) and len(ids) == len(logprobs) == len(versions)
        ):
            raise EngineError(f"{where}: a malformed token line: {raw[:80]!r}")
        return TokenBatch(ids, logprobs, versions)
    if "hb" in d:
        return None
    if "error" in d:
        if d.get("kind") == "bad_request":
            raise ValueError(d["error"])
        raise EngineError(f"{where}: {d['error']}")
    if "finish" in d:
        return Finished(FinishReason(d["finish"]))
    raise EngineError(f"{where}: an unknown stream line {raw[:80]!r}")
