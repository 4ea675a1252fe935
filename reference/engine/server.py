"""An inference engine behind HTTP, so that each engine lives in its own process.

The trajectory manager never runs a model in its own event loop: it reaches engines through
`HTTPEngine` (reference/engine/client.py), which speaks the small protocol served here (its wire format,
request bodies and stream lines, is reference/engine/wire.py; the listening sockets, sockets.py).

    POST /generate        {"request_id", "prompt_token_ids" or "prompt_ids_b64", "params": {...}} -> NDJSON:
                          {"t": [ids], "l": [logprobs], "v": [versions]} per batch of tokens (those
                          waiting when the line is written), then {"finish": reason};
                          {"hb": 1} while quiet; {"error": message, "kind": "bad_request" | "engine"}
    POST /generate_many   {"requests": [generate bodies]} -> one NDJSON stream of the lines above, each
                          tagged with its request's index: {"r": 0, "t": [...], ...}; a request that
                          is malformed or rejected gets its own error line, the others go on
    POST /pause | /resume
    POST /update_weights  {"version": int, "source": str | null}
    POST /abort           {"request_id": str} or {"request_ids": [str]}
    GET  /stats | /health
    GET  /timeline        {"now_s", "intervals": [...]}: what the engine did (engines that keep one)

A malformed body gets a 400 (wrong JSON types are never coerced; NaN, Infinity and too deeply
nested JSON are malformed); a request the engine rejects (a prompt too long, an id outside the
vocabulary) gets a "bad_request" error line before any token. A client that disconnects
mid-stream aborts its request, which frees the engine's slot. An engine started with a token
answers 401 to any call but /health without `Authorization: Bearer <token>` (auth.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

from aiohttp import web

from reference.engine.auth import auth_middleware
from reference.engine.base import Finished, InferenceEngine, TokenEvent
from reference.engine.sockets import listen_sockets, serve_on
from reference.engine.wire import (
    HEARTBEAT_LINE,
    MAX_ABORTS,
    MAX_BATCH,
    brief,
    error_line,
    finish_line,
    loads_strict,
    parse_generate,
    tagged_line,
    token_fields,
    tokens_line,
)

log = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", object)
HEARTBEAT_KEY = web.AppKey("heartbeat_s", float)
HEARTBEAT_S = 5.0  # a quiet stream gets a {"hb": 1} line this often
COALESCE_KEY = web.AppKey("coalesce_s", float)
# Tokens already waiting when a line is written always travel together; a window > 0 also waits that
# long after a token for more (fewer lines for the manager to parse, at that much added latency).
COALESCE_S = 0.0


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _json_body(request: web.Request) -> Any:
    try:
        text = await request.text()
    except UnicodeDecodeError as e:
        raise ValueError(f"body is not valid JSON: {e}") from None
    return loads_strict(text)


async def handle_generate(request: web.Request) -> web.StreamResponse:
    engine: InferenceEngine = request.app[ENGINE_KEY]
    try:
        gen = parse_generate(await _json_body(request))
    except ValueError as e:
        return _bad(str(e))
    # Headers go out at once and a heartbeat line whenever the stream is quiet (a pause for a weight
    # update can last minutes), so the client can tell a slow engine from a hung one by read timeouts.
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        await response.prepare(request)
    except ConnectionResetError:  # the client went away before the stream started: nothing to do
        return response
    writer = _LineWriter(response, request.app[HEARTBEAT_KEY])
    pump = _Pump(engine.stream(gen))
    try:
        while True:
            batch = await pump.batch(request.app[COALESCE_KEY])
            tokens = [e for e in batch if isinstance(e, TokenEvent)]
            if tokens:
                await writer.write(tokens_line(tokens))
            if isinstance(batch[-1], Finished):
                await writer.write(finish_line(batch[-1]))
                break
        await response.write_eof()
    except ConnectionResetError:  # the client went away mid-stream (the request is aborted below)
        pass
    except ValueError as e:  # the engine rejected the request, before any token
        await _last_line(writer, response, error_line(str(e), "bad_request"))
    except Exception as e:  # engine failure mid-stream: tell the client, which retries elsewhere
        log.exception("generation %s failed", gen.request_id)
        await _last_line(writer, response, error_line(f"{type(e).__name__}: {e}", "engine"))
    finally:
        writer.stop()
        await pump.close()  # on a disconnect this aborts the request and frees its slot
    return response


async def handle_generate_many(request: web.Request) -> web.StreamResponse:
    """Several generations in one streamed response, each line tagged with its request's index ("r"):
    one HTTP round trip and one socket write per burst for a whole batch of samples. Each request
    fails alone (a malformed one, or one the engine rejects, gets its own error line); closing the
    response aborts every request still running."""
    engine: InferenceEngine = request.app[ENGINE_KEY]
    try:
        body = await _json_body(request)
        items = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH:
            raise ValueError(f"requests must be a list of 1 to {MAX_BATCH} generate calls, got {brief(items)}")
    except ValueError as e:
        return _bad(str(e))
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        await response.prepare(request)
    except ConnectionResetError:
        return response
    out: asyncio.Queue = asyncio.Queue()  # (index, TokenEvent | Finished | (kind, message))
    tasks = [asyncio.create_task(_run_one(engine, i, item, out)) for i, item in enumerate(items)]
    writer = _LineWriter(response, request.app[HEARTBEAT_KEY])
    running, window_s = len(items), request.app[COALESCE_KEY]
    try:
        while running:
            burst = [await out.get()]
            if window_s > 0:
                await asyncio.sleep(window_s)
            while not out.empty():
                burst.append(out.get_nowait())
            lines, ended = _burst_lines(burst)
            running -= ended
            await writer.write(b"".join(lines))
        await response.write_eof()
    except ConnectionResetError:  # the client went away: its requests are aborted below
        pass
    finally:
        writer.stop()
        for task in tasks:
            task.cancel()  # a running engine stream is closed, which aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)
    return response


async def _run_one(engine: InferenceEngine, index: int, item: Any, out: asyncio.Queue) -> None:
    """Feed one request's events into `out`; it always ends with a Finished or an error."""
    try:
        gen = parse_generate(item)
    except ValueError as e:
        out.put_nowait((index, ("bad_request", str(e))))
        return
    events = engine.stream(gen)
    try:
        async for event in events:
            out.put_nowait((index, event))
            if isinstance(event, Finished):
                return
        out.put_nowait((index, ("engine", "the engine ended the stream without a finish")))
    except ValueError as e:  # rejected before any token
        out.put_nowait((index, ("bad_request", str(e))))
    except Exception as e:  # noqa: BLE001 - an engine failure mid-stream fails this request only
        log.exception("generation %s failed", gen.request_id)
        out.put_nowait((index, ("engine", f"{type(e).__name__}: {e}")))
    finally:
        await events.aclose()


def _burst_lines(burst: list) -> tuple[list[bytes], int]:
    """The lines for a burst of (index, event) pairs: each request's consecutive tokens in one line;
    how many requests the burst ended."""
    lines: list[bytes] = []
    tokens: dict[int, list[TokenEvent]] = {}
    ended = 0

    def flush(index: int) -> None:
        if run := tokens.pop(index, None):
            lines.append(tagged_line(index, token_fields(run)))

    for index, item in burst:
        if isinstance(item, TokenEvent):
            tokens.setdefault(index, []).append(item)
            continue
        flush(index)
        ended += 1
        if isinstance(item, Finished):
            lines.append(tagged_line(index, {"finish": str(item.reason)}))
        else:
            kind, message = item
            lines.append(tagged_line(index, {"error": message, "kind": kind}))
    for index in list(tokens):
        flush(index)
    return lines, ended


async def _last_line(writer: _LineWriter, response: web.StreamResponse, line: bytes) -> None:
    try:
        await writer.write(line)
        await response.write_eof()
    except ConnectionResetError:
        pass


class _Pump:
    """Reads an engine stream in a task, so that tokens that arrive close together can be sent as one
    line: a fast engine's tokens then cost the manager one JSON parse per batch, not per token."""

    def __init__(self, events) -> None:
        self.events = events
        self.queue: asyncio.Queue = asyncio.Queue()
        self.error: Exception | None = None  # an engine failure held back until its tokens are sent
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for event in self.events:
                self.queue.put_nowait(event)
        except Exception as e:  # handed to the writer, which reports it
            self.queue.put_nowait(e)

    async def batch(self, window_s: float, limit: int = 1024) -> list:
        """The next event, plus whatever else arrived within `window_s` of it (a Finished ends a batch);
        an engine exception is raised here."""
        if self.error is not None:
            raise self.error
        batch = [await self.queue.get()]
        if window_s > 0 and isinstance(batch[0], TokenEvent):
            await asyncio.sleep(window_s)
        while isinstance(batch[-1], TokenEvent) and len(batch) < limit and not self.queue.empty():
            batch.append(self.queue.get_nowait())
        if isinstance(batch[-1], Exception):
            if len(batch) == 1:
                raise batch[0]
            self.error = batch.pop()  # deliver the tokens first; the error comes with the next batch
        return batch

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()  # cancels the engine stream, which aborts the request
            await asyncio.gather(self.task, return_exceptions=True)
        await self.events.aclose()


class _LineWriter:
    """Writes whole lines to a streamed response, and a heartbeat line after `heartbeat_s` of quiet."""

    def __init__(self, response: web.StreamResponse, heartbeat_s: float) -> None:
        self.response, self.heartbeat_s = response, heartbeat_s
        self._lock = asyncio.Lock()
        self._last = time.monotonic()
        self._beat = asyncio.create_task(self._heartbeat()) if heartbeat_s > 0 else None

    async def write(self, line: bytes) -> None:
        async with self._lock:
            await self.response.write(line)
            self._last = time.monotonic()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._last + self.heartbeat_s - time.monotonic()))
            if time.monotonic() - self._last >= self.heartbeat_s:
                try:
                    await self.write(HEARTBEAT_LINE)
                except (ConnectionResetError, RuntimeError):
                    return

    def stop(self) -> None:
        if self._beat is not None:
            self._beat.cancel()


async def handle_pause(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].pause()
    return web.json_response({"ok": True})


async def handle_resume(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].resume()
    return web.json_response({"ok": True})


async def handle_update_weights(request: web.Request) -> web.Response:
    try:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        version, source = body.get("version"), body.get("source")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an integer, got {version!r}")
        if source is not None and not isinstance(source, str):
            raise ValueError(f"source must be a checkpoint directory path or null, got {source!r}")
        await request.app[ENGINE_KEY].update_weights(version, source)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        return _bad(str(e), 409 if isinstance(e, RuntimeError) else 400)
    return web.json_response({"ok": True, "version": version})


async def handle_abort(request: web.Request) -> web.Response:
    try:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        if "request_ids" in body:
            ids = body["request_ids"]
            if not (isinstance(ids, list) and len(ids) <= MAX_ABORTS and all(isinstance(r, str) for r in ids)):
                raise ValueError(f"request_ids must be a list of at most {MAX_ABORTS} strings")
        elif isinstance(body.get("request_id"), str):
            ids = [body["request_id"]]
        else:
            raise ValueError("request_id must be a string (or request_ids a list of strings)")
    except ValueError as e:
        return _bad(str(e))
    engine = request.app[ENGINE_KEY]
    await asyncio.gather(*(engine.abort(rid) for rid in ids))  # posted together: one engine step serves them all
    return web.json_response({"ok": True, "aborted": len(ids)})


async def handle_stats(request: web.Request) -> web.Response:
    s = await request.app[ENGINE_KEY].stats()
    return web.json_response(
        {
            "running": s.running,
            "waiting": s.waiting,
            "version": s.version,
            "paused": s.paused,
            "max_context": s.max_context,
            "extra": s.extra,
        }
    )


async def handle_timeline(request: web.Request) -> web.Response:
    timeline = getattr(request.app[ENGINE_KEY], "timeline", None)
    if timeline is None:
        return _bad("this engine keeps no timeline", 501)
    return web.json_response(await timeline())


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def build_app(
    engine: InferenceEngine,
    max_body_bytes: int = 64 << 20,
    heartbeat_s: float = HEARTBEAT_S,
    coalesce_s: float = COALESCE_S,
    token: str | None = None,
) -> web.Application:
    """The engine's HTTP app; with a `token`, every endpoint but /health needs `Authorization: Bearer <token>`."""
    middlewares = [] if token is None else [auth_middleware(token)]
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[ENGINE_KEY] = engine
    app[HEARTBEAT_KEY] = heartbeat_s
    app[COALESCE_KEY] = coalesce_s
    app.add_routes(
        [
            web.post("/generate", handle_generate),
            web.post("/generate_many", handle_generate_many),
            web.post("/pause", handle_pause),
            web.post("/resume", handle_resume),
            web.post("/update_weights", handle_update_weights),
            web.post("/abort", handle_abort),
            web.get("/stats", handle_stats),
            web.get("/timeline", handle_timeline),
            web.get("/health", handle_health),
        ]
    )
    return app


async def start_engine_server(
    engine: InferenceEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    heartbeat_s: float = HEARTBEAT_S,
    coalesce_s: float = COALESCE_S,
    token: str | None = None,
    *,
    sockets: list[socket.socket] | None = None,
) -> web.AppRunner:
    """Serve `engine` in the running loop; returns the runner (its bound port: `bound_port(runner)`).
    With a `token`, callers must send it (see reference/engine/auth.py). `sockets`: already listening
    (`listen_sockets`), instead of binding `host`:`port` here."""
    sockets = listen_sockets(host, port) if sockets is None else sockets
    app = build_app(engine, heartbeat_s=heartbeat_s, coalesce_s=coalesce_s, token=token)
    return await serve_on(web.AppRunner(app, handler_cancellation=True, access_log=None), sockets)
