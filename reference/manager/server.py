"""The trajectory manager's HTTP face: an OpenAI-compatible server with the session in the URL.

    POST /s/<session_id>/v1/chat/completions   (stream=true too)
    POST /s/<session_id>/v1/completions
    GET  /s/<session_id>/v1/models             (and /v1/models)
    GET  /trajectories                         session ids
    GET  /trajectories/<session_id>            the session's trajectory tree (prefix_tree.to_json), annotations
    POST /trajectories/<session_id>            annotate it: {"reward", "branch_rewards", "task_id", "meta", "author"}
    POST /admin/pause | /admin/resume          partial rollout: hold generation at a token boundary
                                               {"engines": [names]} (optional; default: every engine)
    POST /admin/update_weights                 {"version": int, "source": checkpoint dir | null, "engines"}
    POST /admin/preempt                        {"engine": name}: its requests continue elsewhere, with
                                               their tokens; it takes no new request
    POST /admin/serve                          {"engine": name, "serving": bool}
    GET  /health | /stats

Sampling takes the OpenAI fields (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n`, `stream`,
`logprobs`; a chat request's `seed` is mixed with the number of assistant messages before it, so one seed sent
on every turn draws anew on each: `chat.turn_seed`) and one extra field, as vLLM's OpenAI server does:
`"ignore_eos": true` makes the stop tokens (`<|im_end|>`, `<|endoftext|>`) ordinary tokens, so a sample
without `stop` strings ends only at `max_tokens` (finish reason "length") and its text keeps them; a workload
that forces response lengths uses it. Anything but a boolean is a 400 naming the field.

Access: with an admin token set, everything except the agents' own `/s/<session>/v1/*` calls, `/v1/models`
and `/health` needs `Authorization: Bearer <token>`: reading and annotating trajectories (rewards decide
what the model learns), stats, and the control endpoints.

Every error is an OpenAI-style JSON body with a 4xx/5xx status (also for what aiohttp rejects before a
handler runs: an over-long request line, a malformed header), and the server keeps serving. A URL nothing
serves (a client given the usual `http://HOST:PORT/v1` base URL) gets a 404, token or not, whose message
says to use `base_url = http://HOST:PORT/s/<session_id>/v1`. Large bodies are parsed and tokenised in a
worker thread (the tokenizer releases the GIL), so one huge request never stalls the others; trees are
serialised off the loop too. Handlers are cancelled when the client disconnects, which aborts the engine
request.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import math
import socket
import time
import uuid
from contextlib import aclosing
from dataclasses import replace
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from reference.engine.auth import authorized
from reference.engine.base import MAX_SEED
from reference.engine.sockets import listen_sockets, serve_on
from reference.manager.chat import (
    RequestError,
    chat_logprobs,
    encode_text,
    message_text,
    now_s,
    parse_chat,
    parse_completion,
    usage,
)
from reference.manager.manager import Outcome, TrajectoryManager, check_session_id
from reference.manager.tools import parse_tool_calls

log = logging.getLogger(__name__)

MANAGER_KEY = web.AppKey("manager", TrajectoryManager)
OPEN_PATHS = ("/health", "/v1/models")  # needing no token (besides the agents' /s/<session>/v1/*)
MAX_JSON_DEPTH = 64  # nesting of objects and arrays in a request body
OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed and tokenised in a worker thread
MAX_LINE_BYTES = 16 << 10  # the request line, and each header
MAX_HEADERS = 64  # header lines a request: with MAX_LINE_BYTES, at most 1 MiB of headers buffered a connection
FD_RESERVE = 128  # open files kept free beyond the connections: the store, engines' sockets, /health's connection
ACCEPT_BATCH = 32  # connections asyncio accepts in one go (its `backlog`): room is made for them before the next
LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (aiohttp's default of 128 drops bursts)


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        _check_web_origin(request)  # every endpoint, token or not: a web page must not drive the manager
        if isinstance(request.match_info.http_exception, web.HTTPNotFound):
            raise _no_such_endpoint(request)  # before the token check: an agent with a wrong base URL is told so
        if not (request.path.startswith("/s/") or request.path in OPEN_PATHS):
            _check_token(request)
        return await handler(request)
    except RequestError as e:
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(e.status, e.text if e.status == 413 and e.text else e.reason)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path[:200])
        return _error_response(500, "internal server error")


def _error_response(status: int, message: str) -> web.Response:
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    return web.json_response(RequestError(message, status=status, code=code).body(), status=status)


def _no_such_endpoint(request: web.Request) -> RequestError:
    """The 404 for a URL nothing serves; it says where the OpenAI endpoints are, since a client given the
    usual `http://HOST:PORT/v1` base URL lands here."""
    return RequestError(
        f"{request.method} {request.path[:100]} is not served here: OpenAI calls take the session in the URL. "
        f"Use base_url = {request.scheme}://{request.host[:100]}/s/<session_id>/v1 (one session id per agent "
        f"episode), which serves POST chat/completions, POST completions and GET models",
        status=404,
        code="not_found",
    )


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def host_name(authority: str) -> str:
    """The host of a Host header or an origin's authority, lower case, without its port, brackets or final dot."""
    host = authority.strip().lower()
    if host.startswith("["):  # [v6]:port
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def host_allowed(authority: str, allowed: tuple[str, ...] = ()) -> bool:
    """Whether a request naming this Host may be served: an IP address or a loopback name (a page that rebinds
    its domain to this machine still names its domain), or a name in `allowed` ("*": any)."""
    name = host_name(authority)
    if not name or "*" in allowed or name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in {host_name(a) for a in allowed}


def _check_web_origin(request: web.Request) -> None:
    """403 for what a web page in the user's browser sends: a Host that is not this machine's (DNS rebinding), an
    Origin other than this server's own, or a request the browser marks cross-site. Agents and other clients
    that are not browsers send no Origin."""
    config = request.app[MANAGER_KEY].config
    host = request.headers.get("Host", "")
    if not host_allowed(host, config.allowed_hosts):
        raise RequestError(
            f"Host {host[:100]!r} is not served here: a loopback name or an IP address, or a name "
            f"given with --allowed-host",
            status=403,
            code="forbidden_host",
        )
    origin = request.headers.get("Origin")
    own = origin is not None and origin.partition("://")[2].lower() == host.lower()
    if origin is not None and not own and "*" not in config.allowed_origins and origin not in config.allowed_origins:
        raise RequestError(
            f"Origin {origin[:100]!r} may not call this server: browsers' cross-site requests are "
            f"refused unless the origin is given with --allowed-origin",
            status=403,
            code="forbidden_origin",
        )
    if origin is None and request.headers.get("Sec-Fetch-Site") == "cross-site" and "*" not in config.allowed_origins:
        raise RequestError(
            "a cross-site request from a browser may not call this server", status=403, code="forbidden_origin"
        )


def _check_token(request: web.Request) -> None:
    token = request.app[MANAGER_KEY].config.admin_token
    if token is None:
        return
    if not authorized(request.headers.get("Authorization"), token):
        raise RequestError(
            f"{request.path[:100]} needs 'Authorization: Bearer <admin token>'", status=401, code="unauthorized"
        )


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


async def _body(request: web.Request):
    raw = await request.read()  # aiohttp answers 413 here for a body over client_max_size
    return (_parse_json(raw) if len(raw) <= OFF_LOOP_BYTES else await asyncio.to_thread(_parse_json, raw)), len(raw)


HUGE_BYTES = 1 << 20  # bodies over this are parsed and tokenised one at a time (TrajectoryManager.body_threads)


async def _agent_body(request: web.Request, manager: TrajectoryManager) -> tuple[bytes, int]:
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


def _chat_body(raw: bytes):
    return parse_chat(_parse_json(raw))


def _completion_body(raw: bytes):
    return parse_completion(_parse_json(raw))


async def _off_loop(manager: TrajectoryManager, size: int, fn, *args):
    """`fn(*args)` for a body of `size` bytes: on the event loop when it is small, else in the manager's body
    threads (one at a time for a huge one)."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    pool = manager.body_threads["huge" if size > HUGE_BYTES else "large"]
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


def _trajectory_info(o: Outcome) -> dict:
    """Non-standard fields (OpenAI clients ignore them): where this completion lives in the session."""
    return {
        "session_id": o.session_id,
        "request_id": o.request_id,
        "branch_id": o.branch_id,
        "token_ids": list(o.token_ids),
        "versions": list(o.versions),
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER_KEY]
    sid = check_session_id(request.match_info["session_id"])
    raw, held = await _agent_body(request, manager)
    with manager.admit():  # (no await since `_agent_body` checked the limit)
        try:
            size = len(raw)
            chat = await _off_loop(manager, size, _chat_body, raw)
            del raw
            manager.check_model(chat.model)
            if size > OFF_LOOP_BYTES:  # a text far over the context is refused before it is tokenised
                manager.check_text_length(sum(len(message_text(m, i)) for i, m in enumerate(chat.messages)))
            session = await manager.session(sid)
            prompt, fresh = await _off_loop(manager, size, session.renderer.render_pending, chat.messages, chat.tools)
        finally:
            manager.release_body(held)
        manager.budget(len(prompt), chat.sampling)  # a rejected request leaves nothing behind
        with manager.accepted(session, fresh, len(prompt)) as session:
            if chat.sampling.stream:
                return await _stream(
                    request, manager, session, prompt, chat.sampling, chat=True, tools=bool(chat.tools)
                )
            outcomes = await _run_n(manager, session, prompt, chat.sampling)
    choices = []
    for i, o in enumerate(outcomes):
        message, finish = _assistant_message(o, bool(chat.tools))
        logprobs = chat_logprobs(manager.tok, o.token_ids, o.logprobs) if chat.sampling.logprobs else None
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": logprobs,
                "trajectory": _trajectory_info(o),
            }
        )
    first = choices[0]["trajectory"]
    return web.json_response(
        {
            "id": f"chatcmpl-{outcomes[0].request_id}",
            "object": "chat.completion",
            "created": now_s(),
            "model": manager.config.model_name,
            "choices": choices,
            "usage": _usage(outcomes),
            "trajectory": first,
        }
    )


async def _run_n(manager: TrajectoryManager, session, prompt, sampling) -> list[Outcome]:
    """`sampling.n` samples of one prompt, generated concurrently (seed + i for sample i when seeded,
    wrapping around within the allowed seed range)."""
    if sampling.n == 1:
        return [await manager.complete(session, prompt, sampling)]
    seeds = [None if sampling.seed is None else (sampling.seed + i) % (MAX_SEED + 1) for i in range(sampling.n)]
    runs = (manager.complete(session, prompt, replace(sampling, seed=s)) for s in seeds)
    return list(await asyncio.gather(*runs))


def _usage(outcomes: list[Outcome]) -> dict:
    return usage(len(outcomes[0].prompt_token_ids), sum(len(o.token_ids) for o in outcomes), outcomes[0].cached_tokens)


def _assistant_message(o: Outcome, tools: bool) -> tuple[dict, str]:
    """The OpenAI message for a completion, with tool calls parsed out when tools were offered."""
    calls = []
    if tools:
        content, calls = parse_tool_calls(o.text)
    if not calls:
        return {"role": "assistant", "content": o.text}, o.finish_reason
    finish = "tool_calls" if o.finish_reason == "stop" else o.finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, finish


async def completions(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER_KEY]
    sid = check_session_id(request.match_info["session_id"])
    raw, held = await _agent_body(request, manager)
    with manager.admit():  # (no await since `_agent_body` checked the limit)
        try:
            size = len(raw)
            req = await _off_loop(manager, size, _completion_body, raw)
            del raw
            manager.check_model(req.model)
            session = await manager.session(sid)
            prompt = req.prompt
            if isinstance(prompt, str):
                manager.check_text_length(len(prompt))  # before tokenising a text far over the context
                prompt = await _off_loop(manager, size, encode_text, manager.tok, prompt)
        finally:
            manager.release_body(held)
        manager.budget(len(prompt), req.sampling)
        with manager.accepted(session, None, len(prompt)) as session:
            if req.sampling.stream:
                return await _stream(request, manager, session, prompt, req.sampling, chat=False)
            outcomes = await _run_n(manager, session, prompt, req.sampling)
    echo = (req.prompt if isinstance(req.prompt, str) else manager.tok.decode(req.prompt)) if req.echo else ""
    choices = []
    for i, o in enumerate(outcomes):
        choice = {
            "index": i,
            "text": echo + o.text,
            "finish_reason": o.finish_reason,
            "logprobs": None,
            "trajectory": _trajectory_info(o),
        }
        if req.sampling.logprobs:
            pieces = [manager.tok.decode([t]) for t in o.token_ids]
            choice["logprobs"] = {
                "tokens": pieces,
                "token_logprobs": list(o.logprobs),
                "top_logprobs": None,
                "text_offset": None,
            }
        choices.append(choice)
    return web.json_response(
        {
            "id": f"cmpl-{outcomes[0].request_id}",
            "object": "text_completion",
            "created": now_s(),
            "model": manager.config.model_name,
            "choices": choices,
            "usage": _usage(outcomes),
            "trajectory": _trajectory_info(outcomes[0]),
        }
    )


def _chunk(manager, chat: bool, cid: str, text: str | None, finish: str | None, first: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        kind = "text_completion"
    return {"id": cid, "object": kind, "created": now_s(), "model": manager.config.model_name, "choices": [choice]}


async def _stream(
    request, manager: TrajectoryManager, session, prompt, sampling, chat: bool, tools: bool = False
) -> web.StreamResponse:
    """Server-sent events. With tools offered, the text is held back until the end, when it is sent
    as content and parsed tool calls (no partial tool-call deltas)."""
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:20]}"
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(obj: dict | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        await response.write(f"data: {data}\n\n".encode())

    if chat:
        await send(_chunk(manager, chat, cid, "", None, first=True))
    try:
        async with aclosing(manager.generate(session, prompt, sampling)) as events:
            async for item in events:
                if isinstance(item, Outcome):
                    finish = item.finish_reason
                    if tools:
                        message, finish = _assistant_message(item, tools)
                        delta = {"content": message["content"]} if message.get("content") else {}
                        if message.get("tool_calls"):
                            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
                        chunk = _chunk(manager, chat, cid, None, None)
                        chunk["choices"][0]["delta"] = delta
                        await send(chunk)
                    final = _chunk(manager, chat, cid, None, finish)
                    final["trajectory"] = _trajectory_info(item)
                    await send(final)
                    if sampling.include_usage:
                        u = usage(len(item.prompt_token_ids), len(item.token_ids), item.cached_tokens)
                        await send({**_chunk(manager, chat, cid, None, None), "choices": [], "usage": u})
                elif not tools:
                    await send(_chunk(manager, chat, cid, item, None))
    except RequestError as e:  # the status line is gone: report the error in the stream
        await send(e.body())
    await send("[DONE]")
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    manager = request.app[MANAGER_KEY]
    card = {
        "id": manager.config.model_name,
        "object": "model",
        "created": now_s(),
        "owned_by": "seamlessflow",
        "max_model_len": manager.max_context,
    }
    return web.json_response({"object": "list", "data": [card]})


async def list_trajectories(request: web.Request) -> web.Response:
    return web.json_response({"sessions": await request.app[MANAGER_KEY].session_ids()})


async def get_trajectory(request: web.Request) -> web.Response:
    sid = request.match_info["session_id"]
    tree = await request.app[MANAGER_KEY].trajectory(sid)
    if tree is None:
        raise RequestError(f"no session {sid!r}", status=404, code="session_not_found")
    body = await asyncio.to_thread(dumps_in_slices, tree)  # a big tree serialises off the loop
    return web.Response(body=body, content_type="application/json")


def dumps_in_slices(obj, slice_len: int = 4096) -> bytes:
    """`json.dumps(obj, separators=(",", ":")).encode()`, with long lists serialised `slice_len` items at
    a time. One `json.dumps` call is one C call that holds the GIL until it returns (a second for a 25 MB
    tree), so serialising it in a worker thread would still stall the event loop; between slices the
    loop gets its turn."""
    parts: list[str] = []
    dumps = json.JSONEncoder(separators=(",", ":")).encode

    def put(value) -> None:
        if isinstance(value, dict):
            parts.append("{")
            for i, (key, item) in enumerate(value.items()):
                parts.append(("," if i else "") + json.dumps(str(key)) + ":")
                put(item)
            parts.append("}")
        elif isinstance(value, list) and len(value) > slice_len:
            parts.append("[")
            for start in range(0, len(value), slice_len):
                parts.append(("," if start else "") + dumps(value[start : start + slice_len])[1:-1])
            parts.append("]")
        elif isinstance(value, list):
            parts.append("[")
            for i, item in enumerate(value):
                if i:
                    parts.append(",")
                put(item)
            parts.append("]")
        else:
            parts.append(dumps(value))

    put(obj)
    return "".join(parts).encode()


async def annotate_trajectory(request: web.Request) -> web.Response:
    sid = request.match_info["session_id"]
    manager = request.app[MANAGER_KEY]
    body, _ = await _body(request)
    author = f"{request.remote} {request.headers.get('User-Agent', '')[:80]}".strip()
    return web.json_response({"session_id": sid, "annotations": await manager.annotate(sid, body, author)})


async def _admin_body(request: web.Request) -> dict:
    """A control call's JSON object ({} for an empty body)."""
    if not request.can_read_body:
        return {}
    body, _ = await _body(request)
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _engines_arg(body: dict) -> list[str] | None:
    engines = body.get("engines")
    if engines is not None and not (isinstance(engines, list) and engines and all(isinstance(e, str) for e in engines)):
        raise RequestError(
            f"'engines' must be a non-empty list of engine names or null, got {engines!r}", param="engines"
        )
    return engines


async def _control(call, param: str = "engines"):
    """Run a control call; its refusals become 4xx errors."""
    try:
        return await call
    except RuntimeError as e:
        raise RequestError(str(e), status=409, code="conflict") from None
    except (ValueError, FileNotFoundError) as e:
        raise RequestError(str(e), param=param) from None


async def admin_pause(request: web.Request) -> web.Response:
    engines = _engines_arg(await _admin_body(request))
    start = time.perf_counter()
    await _control(request.app[MANAGER_KEY].pause(engines))
    return web.json_response({"ok": True, "pause_s": time.perf_counter() - start})


async def admin_resume(request: web.Request) -> web.Response:
    engines = _engines_arg(await _admin_body(request))
    await _control(request.app[MANAGER_KEY].resume(engines))
    return web.json_response({"ok": True})


async def admin_update_weights(request: web.Request) -> web.Response:
    body = await _admin_body(request)
    version, source, engines = body.get("version"), body.get("source"), _engines_arg(body)
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**63:
        raise RequestError(f"'version' must be an integer in [0, 2**63), got {version!r}", param="version")
    if source is not None and not isinstance(source, str):
        raise RequestError(f"'source' must be a checkpoint directory or null, got {source!r}", param="source")
    try:
        await request.app[MANAGER_KEY].update_weights(version, source, engines)
    except RuntimeError as e:
        raise RequestError(str(e), status=409, code="not_paused") from None
    except (ValueError, FileNotFoundError) as e:
        raise RequestError(str(e), param="source") from None
    return web.json_response({"ok": True, "version": version})


async def admin_preempt(request: web.Request) -> web.Response:
    """{"engine": name}: take it out of service; its requests continue on other engines with their tokens."""
    body = await _admin_body(request)
    engine = body.get("engine")
    if not isinstance(engine, str):
        raise RequestError(f"'engine' must be an engine name, got {engine!r}", param="engine")
    start = time.perf_counter()
    try:
        moved = await _control(request.app[MANAGER_KEY].preempt(engine), "engine")
    except TimeoutError as e:
        raise RequestError(str(e), status=504, code="timeout") from None
    return web.json_response({"ok": True, "moved": moved, "preempt_s": time.perf_counter() - start})


async def admin_serve(request: web.Request) -> web.Response:
    """{"engine": name, "serving": bool}: whether the engine takes new requests."""
    body = await _admin_body(request)
    engine, serving = body.get("engine"), body.get("serving")
    if not isinstance(engine, str):
        raise RequestError(f"'engine' must be an engine name, got {engine!r}", param="engine")
    if not isinstance(serving, bool):
        raise RequestError(f"'serving' must be true or false, got {serving!r}", param="serving")
    try:
        request.app[MANAGER_KEY].set_serving(engine, serving)
    except ValueError as e:
        raise RequestError(str(e), param="engine") from None
    return web.json_response({"ok": True})


async def health(request: web.Request) -> web.Response:
    report = request.app[MANAGER_KEY].health()
    return web.json_response(report, status=200 if report["ok"] else 503)


async def stats(request: web.Request) -> web.Response:
    return web.json_response(await request.app[MANAGER_KEY].stats())


def build_app(manager: TrajectoryManager) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=manager.config.max_body_bytes)
    app[MANAGER_KEY] = manager
    app.on_cleanup.append(lambda _: manager.close())
    prefix = "/s/{session_id}/v1"
    app.add_routes(
        [
            web.post(f"{prefix}/chat/completions", chat_completions),
            web.post(f"{prefix}/completions", completions),
            web.get(f"{prefix}/models", models),
            web.get("/v1/models", models),
            web.get("/trajectories", list_trajectories),
            web.get("/trajectories/{session_id}", get_trajectory),
            web.post("/trajectories/{session_id}", annotate_trajectory),
            web.post("/admin/pause", admin_pause),
            web.post("/admin/resume", admin_resume),
            web.post("/admin/update_weights", admin_update_weights),
            web.post("/admin/preempt", admin_preempt),
            web.post("/admin/serve", admin_serve),
            web.get("/health", health),
            web.get("/stats", stats),
        ]
    )
    return app


class _JSONErrors(RequestHandler):
    """What aiohttp rejects before any handler runs (an over-long request line, a malformed header or
    method) is answered with the same OpenAI-style JSON error as everything else. Connections are counted;
    past the manager's `max_connections` the oldest with no request under way (idle, or its headers not all
    in) is closed to make room, else the new one."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        manager = self._manager.manager
        manager.connections += 1
        cap = manager.max_connections
        if cap is not None and manager.connections > cap:
            open_ = (h for h in self._manager.connections if h is not self and h.transport is not None)
            idle = next((h for h in open_ if not h._request_in_progress), self)
            manager.connections_closed += 1
            idle.force_close()

    def connection_lost(self, exc) -> None:
        self._manager.manager.connections -= 1
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response was already sent
        text = "internal server error" if status >= 500 else (message or HTTPStatus(status).phrase)
        response = _error_response(status, text.splitlines()[0][:300] if text else HTTPStatus(status).phrase)
        response.force_close()
        return response


class _Server(web.Server):
    manager: TrajectoryManager

    def __call__(self) -> RequestHandler:
        return _JSONErrors(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    """An AppRunner whose server answers what aiohttp rejects before a handler with JSON (`_JSONErrors`)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if type(server) is web.Server:
            server.__class__ = _Server
            server.manager = self.app[MANAGER_KEY]
        return server


def open_file_limit() -> int:
    """This process's soft limit on open files, raised to its hard limit first (vLLM raises its own the same
    way): at the usual soft limit of 1,024, a thousand idle connections left no descriptor for /health or the
    store."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # not allowed here: keep what there is
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


async def start_manager_server(
    manager: TrajectoryManager, host: str = "127.0.0.1", port: int = 8000, *, sockets: list[socket.socket] | None = None
) -> web.AppRunner:
    """Serve in the running loop; returns the runner (see reference.engine.server.bound_port). `sockets`:
    already listening (`listen_sockets`, as `serve` binds them before its engines start), instead of
    binding `host`:`port` here; a port in use or a bad host is a UserError, before the manager starts."""
    sockets = listen_sockets(host, port, LISTEN_BACKLOG) if sockets is None else sockets
    try:
        await manager.start()
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    manager.max_connections = max(16, open_file_limit() - FD_RESERVE - ACCEPT_BATCH)
    _quiet_accept_errors(asyncio.get_running_loop())
    runner = _Runner(
        build_app(manager),
        handler_cancellation=True,
        access_log=None,
        max_line_size=MAX_LINE_BYTES,
        max_field_size=MAX_LINE_BYTES,
        max_headers=MAX_HEADERS,
        keepalive_timeout=manager.config.idle_timeout_s,
    )
    # asyncio accepts as many connections in one go as its backlog, before any of them runs: a small batch lets
    # `_JSONErrors` close idle connections between batches; the kernel's queue stays long for bursts.
    runner = await serve_on(runner, sockets, ACCEPT_BATCH)
    for sock in sockets:
        sock.listen(LISTEN_BACKLOG)
    return runner


def _quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log asyncio's "socket.accept() out of system resource" (out of file descriptors) once every 10 s, not once
    for every connection it could not accept (113 MB of tracebacks in 30 s at a 1,024-file limit)."""
    previous = loop.get_exception_handler()
    last = [-math.inf]

    def handler(loop, context: dict) -> None:
        if context.get("message") == "socket.accept() out of system resource":
            if time.monotonic() - last[0] < 10:
                return
            last[0] = time.monotonic()
            log.error("out of file descriptors: connections wait in the kernel's queue (%s)", context.get("exception"))
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
