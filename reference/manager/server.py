"""The trajectory manager's HTTP face: an OpenAI-compatible server with the session in the URL.

    POST /s/<session_id>/v1/chat/completions   (stream=true too)
    POST /s/<session_id>/v1/completions
    GET  /s/<session_id>/v1/models             (and /v1/models)
    /trajectories, /admin/*, /health, /stats   the control plane's endpoints: `admin.py`

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

This module serves the agents' endpoints and starts the server; the rest is in `access.py` (who may call, and
the JSON errors), `bodies.py` (reading and parsing request bodies), `admin.py` (trajectories, control,
health and stats) and `connections.py` (counting, capping and closing connections).
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from contextlib import aclosing
from dataclasses import replace

from aiohttp import web

from reference.engine.base import MAX_SEED
from reference.engine.sockets import listen_sockets, serve_on
from reference.manager import admin
from reference.manager.access import MANAGER_KEY, openai_errors
from reference.manager.bodies import OFF_LOOP_BYTES, agent_body, chat_body, completion_body, off_loop
from reference.manager.chat import (
    RequestError,
    chat_logprobs,
    encode_text,
    message_text,
    now_s,
    usage,
)
from reference.manager.connections import (
    ACCEPT_BATCH,
    FD_RESERVE,
    LISTEN_BACKLOG,
    MAX_HEADERS,
    MAX_LINE_BYTES,
    Runner,
    open_file_limit,
    quiet_accept_errors,
)
from reference.manager.generation import Outcome
from reference.manager.manager import TrajectoryManager, check_session_id
from reference.manager.tools import parse_tool_calls


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
    raw, held = await agent_body(request, manager)
    with manager.admit():  # (no await since `agent_body` checked the limit)
        try:
            size = len(raw)
            chat = await off_loop(manager, size, chat_body, raw)
            del raw
            manager.check_model(chat.model)
            if size > OFF_LOOP_BYTES:  # a text far over the context is refused before it is tokenised
                manager.check_text_length(sum(len(message_text(m, i)) for i, m in enumerate(chat.messages)))
            session = await manager.session(sid)
            prompt, fresh = await off_loop(manager, size, session.renderer.render_pending, chat.messages, chat.tools)
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
    raw, held = await agent_body(request, manager)
    with manager.admit():  # (no await since `agent_body` checked the limit)
        try:
            size = len(raw)
            req = await off_loop(manager, size, completion_body, raw)
            del raw
            manager.check_model(req.model)
            session = await manager.session(sid)
            prompt = req.prompt
            if isinstance(prompt, str):
                manager.check_text_length(len(prompt))  # before tokenising a text far over the context
                prompt = await off_loop(manager, size, encode_text, manager.tok, prompt)
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
            *admin.routes(),
        ]
    )
    return app


async def start_manager_server(
    manager: TrajectoryManager, host: str = "127.0.0.1", port: int = 8000, *, sockets: list[socket.socket] | None = None
) -> web.AppRunner:
    """Serve in the running loop; returns the runner (see reference.engine.sockets.bound_port). `sockets`:
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
    quiet_accept_errors(asyncio.get_running_loop())
    runner = Runner(
        build_app(manager),
        handler_cancellation=True,
        access_log=None,
        max_line_size=MAX_LINE_BYTES,
        max_field_size=MAX_LINE_BYTES,
        max_headers=MAX_HEADERS,
        keepalive_timeout=manager.config.idle_timeout_s,
    )
    # asyncio accepts as many connections in one go as its backlog, before any of them runs: a small batch lets
    # `_Protocol` close idle connections between batches; the kernel's queue stays long for bursts.
    runner = await serve_on(runner, sockets, ACCEPT_BATCH)
    for sock in sockets:
        sock.listen(LISTEN_BACKLOG)
    return runner
