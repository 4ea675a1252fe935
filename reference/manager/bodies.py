"""Request bodies: read within limits, parsed as strict JSON, and parsed or tokenised off the event loop when large.

An agent request's body is admitted before anything of it is read (the in-flight limit, the bytes of bodies
in flight, `max_body_bytes`) and must arrive within `body_timeout_s`. JSON is parsed without NaN or Infinity
and refused when nested deeper than `MAX_JSON_DEPTH`. Bodies over `OFF_LOOP_BYTES` are parsed and tokenised
in worker threads (the tokenizer releases the GIL), so one huge request never stalls the others.
"""

from __future__ import annotations

import asyncio
import functools
import json

from aiohttp import web

from reference.manager.chat import RequestError, parse_chat, parse_completion
from reference.manager.manager import TrajectoryManager

MAX_JSON_DEPTH = 64  # nesting of objects and arrays in a request body
OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed and tokenised in a worker thread


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_depth(value, limit: int = MAX_JSON_DEPTH) -> None:
    """Objects and arrays nested deeper than `limit` are refused (without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        if depth > limit:
            raise RequestError(
                f"the request body nests objects and arrays deeper than {limit} levels", code="invalid_json"
            )
        stack.extend((x, depth + 1) for x in items if isinstance(x, dict | list))


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # one for all requests: it keeps no state


def _loads(raw: bytes):
    """json.loads(raw, parse_constant=_reject_constant), without building a decoder per call."""
    text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return _DECODER.decode(text)


def _parse_json(raw: bytes):
    try:
        body = _loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        message = "it nests too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise RequestError(f"the request body is not valid JSON: {message}", code="invalid_json") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:  # fewer brackets than that cannot nest deeper
        _check_depth(body)
    return body


async def read_json(request: web.Request):
    """A request's JSON body and its size in bytes (parsed in a worker thread when large)."""
    raw = await request.read()  # aiohttp answers 413 here for a body over client_max_size
    return (_parse_json(raw) if len(raw) <= OFF_LOOP_BYTES else await asyncio.to_thread(_parse_json, raw)), len(raw)


HUGE_BYTES = 1 << 20  # bodies over this are parsed and tokenised one at a time (TrajectoryManager.body_threads)


async def agent_body(request: web.Request, manager: TrajectoryManager) -> tuple[bytes, int]:
    """An agent request's body, and the bytes it holds of `max_body_bytes_in_flight` (to release once it is
    tokenised). Before anything is read: 429 when the in-flight cap is reached or the bytes announced would pass
    that limit, 413 beyond `max_body_bytes`. The body must arrive within `body_timeout_s` (else 408); while it
    arrives the request holds no in-flight slot, and once it is in, the in-flight limit is checked again (the
    bytes released on any refusal)."""
    manager.check_admission()
    size = request.content_length
    limit = manager.config.max_body_bytes
    if size is not None and size > limit:
        raise RequestError(
            f"the request body of {size:,} bytes is over the limit of {limit:,}", status=413, code="request_too_large"
        )
    held = limit if size is None else size  # a chunked body may be as large as the limit
    manager.hold_body(held)
    try:
        async with asyncio.timeout(manager.config.body_timeout_s):
            raw = await request.read()  # aiohttp answers 413 here for a chunked body over client_max_size
    except TimeoutError:
        manager.release_body(held)
        raise RequestError(
            f"the request body did not arrive within {manager.config.body_timeout_s:g} s",
            status=408,
            code="request_timeout",
        ) from None
    except BaseException:
        manager.release_body(held)
        raise
    try:
        manager.check_admission()  # the limit may have fallen while the body arrived
    except RequestError:
        manager.release_body(held)
        raise
    return raw, held


def chat_body(raw: bytes):
    return parse_chat(_parse_json(raw))


def completion_body(raw: bytes):
    return parse_completion(_parse_json(raw))


async def off_loop(manager: TrajectoryManager, size: int, fn, *args):
    """`fn(*args)` for a body of `size` bytes: on the event loop when it is small, else in the manager's body
    threads (one at a time for a huge one)."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    pool = manager.body_threads["huge" if size > HUGE_BYTES else "large"]
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
