"""`HTTPEngine`: the `InferenceEngine` protocol over HTTP, reaching an engine in another process.

A connection failure, a dropped stream, a 5xx or a refused token (401) becomes `EngineError` (the
manager retries the request elsewhere); a 400 becomes `ValueError` with the engine's message (the
agent's fault). Generations started together share one `/generate_many` stream (one round trip and
one socket write per burst for many samples); leaving a stream early aborts its request on the
engine. `base_url` may be reassigned (an engine restarted on another port); every call reads it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import aiohttp

from reference.engine.auth import bearer_headers, check_token
from reference.engine.base import (
    EngineError,
    EngineStats,
    Finished,
    GenerateRequest,
    TokenBatch,
    TokenEvent,
)
from reference.engine.wire import MAX_BATCH, parse_line, parse_tagged, request_to_wire

log = logging.getLogger(__name__)


class HTTPEngine:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        connect_timeout_s: float = 5.0,
        control_timeout_s: float = 600.0,
        stall_timeout_s: float = 60.0,
        batch_requests: bool = True,
    ) -> None:
        """`token`: the engine's bearer token (sent on every call but `health`). `stall_timeout_s`: a
        stream that sends nothing, not even the server's heartbeat, for this long is an engine failure
        (a hung or frozen process). `batch_requests`: generations started in the same turn of the event
        loop (the n samples of a prompt, a burst of agents) share one `/generate_many` stream."""
        self.base_url = base_url
        self.batch_requests = batch_requests
        self._pending: list[_Entry] | None = None  # generations waiting for this loop turn's batch
        self._to_abort: list[str] = []
        self._tasks: set[asyncio.Task] = set()
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
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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

    def stream_batches(self, request: GenerateRequest) -> AsyncIterator[TokenBatch | Finished]:
        """`stream`, one `TokenBatch` per line the engine sent."""
        return self._batched(request) if self.batch_requests else self._stream_one(request)

    async def _batched(self, request: GenerateRequest) -> AsyncIterator[TokenBatch | Finished]:
        """A generation that travels in a shared `/generate_many` stream. Leaving early aborts it on the
        engine (or drops it from a batch not yet sent)."""
        entry = _Entry(request, asyncio.Queue())
        if self._pending is None:
            self._pending = []
            asyncio.get_running_loop().call_soon(self._send_pending)
        self._pending.append(entry)
        try:
            while True:
                item = await entry.inbox.get()
                if isinstance(item, BaseException):
                    entry.ended = True
                    raise item
                if isinstance(item, Finished):
                    entry.ended = True
                    yield item
                    return
                yield item
        finally:
            if not entry.ended:
                entry.dropped = True
                if entry.sent:
                    self._abort_soon(request.request_id)

    def _send_pending(self) -> None:
        entries = [e for e in self._pending or () if not e.dropped]
        self._pending = None
        for i in range(0, len(entries), MAX_BATCH):
            self._spawn(self._run_batch(entries[i : i + MAX_BATCH]))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _abort_soon(self, request_id: str) -> None:
        """Aborts of this loop turn go together, in one call."""
        if not self._to_abort:
            asyncio.get_running_loop().call_soon(self._send_aborts)
        self._to_abort.append(request_id)

    def _send_aborts(self) -> None:
        ids, self._to_abort = self._to_abort, []

        async def send() -> None:
            try:
                await self.abort_many(ids)
            except (EngineError, ValueError, RuntimeError) as e:  # the stream's end frees the engine anyway
                log.debug("abort of %d requests on %s failed: %s", len(ids), self.base_url, e)

        self._spawn(send())

    async def _run_batch(self, entries: list[_Entry]) -> None:
        """One `/generate_many` call: each line goes to its request's inbox; a failure of the whole stream
        fails every request still open."""
        open_ = dict(enumerate(entries))
        for entry in entries:
            entry.sent = True
        body = {"requests": [request_to_wire(e.request) for e in entries]}
        error: Exception
        try:
            async with self._ndjson("/generate_many", body) as response:
                async for raw in response.content:
                    index, item = parse_tagged(raw, self.base_url)
                    entry = open_.get(index) if index is not None else None
                    if entry is None:
                        continue  # a heartbeat, or a line for a request that already ended
                    entry.inbox.put_nowait(item)
                    if isinstance(item, Finished | BaseException):
                        del open_[index]
                        if not open_:
                            await response.content.read()  # the end of the body: the connection is reused
                            return
            error = EngineError(f"{self.base_url}: a batch stream ended before {len(open_)} of its requests")
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as e:
            error = EngineError(f"{self.base_url}: {type(e).__name__}: {e}")
        except (EngineError, ValueError) as e:
            error = e
        except asyncio.CancelledError:
            for entry in open_.values():
                entry.inbox.put_nowait(EngineError(f"{self.base_url}: the client was closed"))
            raise
        for entry in open_.values():
            entry.inbox.put_nowait(type(error)(str(error)))

    async def _stream_one(self, request: GenerateRequest) -> AsyncIterator[TokenBatch | Finished]:
        """`stream_batches` in a `/generate` call of its own."""
        try:
            async with self._ndjson("/generate", request_to_wire(request)) as response:
                async for raw in response.content:
                    item = parse_line(raw, self.base_url)
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

    @asynccontextmanager
    async def _ndjson(self, path: str, body: dict) -> AsyncIterator[aiohttp.ClientResponse]:
        """The open response of a streamed call (200); a refused token, a 400 (ValueError: the request's
        fault) or another status raises."""
        # No total timeout: a generation may legitimately wait out a long pause for a weight update;
        # the server's heartbeat keeps the read timeout from firing meanwhile.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=self.stall_timeout_s)
        async with self._http().post(
            f"{self.base_url}{path}", json=body, headers=self._headers, timeout=timeout
        ) as response:
            if response.status == 401:
                raise self._refused(path)
            if response.status == 400:
                raise ValueError((await response.json()).get("error", "bad request"))
            if response.status != 200:
                raise EngineError(f"{self.base_url}: HTTP {response.status}: {await response.text()}")
            yield response

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


@dataclass
class _Entry:
    """A generation in a batched stream: its inbox gets TokenBatch, then Finished or an exception."""

    request: GenerateRequest
    inbox: asyncio.Queue
    sent: bool = False  # its batch has gone to the engine
    ended: bool = False  # its consumer saw the end
    dropped: bool = False  # its consumer left early
