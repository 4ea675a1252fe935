"""A minimal OpenAI chat proxy that records nothing: the anchor for the trajectory manager's CPU cost.

    python -m benchmarks.anchor_proxy --engine-url URL [--port 8001] [--host 127.0.0.1]

It does what any OpenAI-compatible gateway in front of a token-in/token-out engine must do, and no
more: parse the chat request (the manager's own `parse_chat`), render the messages to token ids with
the manager's ChatML renderer (a fresh one per request, so each segment is tokenised once), make the
same streamed engine call through the same client (`HTTPEngine`: calls started together share one
`/generate_many` stream, see reference/engine/server.py), decode the completion and answer a
`chat.completion`. No session, prefix tree, store, retry on
another engine or incremental decoding; `n` > 1 and `stream` are refused. `benchmarks/proxy_overhead.py`
runs it beside the manager: the difference in CPU per request is what recording costs.

Serves `POST /s/<session>/v1/chat/completions` (the manager's URL shape; the session is ignored),
`POST /v1/chat/completions` and `GET /health`. The engine's bearer token, if it has one, comes from
`$SEAMLESSFLOW_ENGINE_TOKEN`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import time
from dataclasses import dataclass

from aiohttp import web

from reference.engine.base import EngineError, Finished, GenerateRequest, SamplingParams
from reference.engine.client import HTTPEngine
from reference.manager.chat import ChatRenderer, find_stop, parse_chat
from reference.manager.errors import RequestError
from reference.tokenizer import default_tokenizer

ENGINE_TOKEN_ENV = "SEAMLESSFLOW_ENGINE_TOKEN"
DEFAULT_MAX_TOKENS = 1024  # as the manager's default


@dataclass
class Anchor:
    engine: HTTPEngine
    model_name: str
    tok: object
    max_context: int
    stop_ids: tuple[int, ...]
    ids: itertools.count


ANCHOR_KEY = web.AppKey("anchor", Anchor)


def _error(message: str, status: int, code: str | None = None) -> web.Response:
    return web.json_response(RequestError(message, status=status, code=code).body(), status=status)


def _max_tokens(a: Anchor, prompt_len: int, asked: int | None) -> int:
    if asked is None:
        asked = min(DEFAULT_MAX_TOKENS, a.max_context - prompt_len)
    if asked < 1 or prompt_len + asked > a.max_context:
        raise RequestError(
            f"the prompt ({prompt_len} tokens) plus max_tokens does not fit the context ({a.max_context})",
            code="context_length_exceeded",
        )
    return asked


async def chat_completions(request: web.Request) -> web.Response:
    a = request.app[ANCHOR_KEY]
    try:
        chat = parse_chat(json.loads(await request.read()))
        if chat.model is not None and chat.model != a.model_name:
            raise RequestError(f"the model {chat.model!r} does not exist", status=404, code="model_not_found")
        if chat.sampling.n > 1 or chat.sampling.stream:
            raise RequestError("the anchor proxy answers only n=1 without streaming")
        prompt = ChatRenderer(a.tok).render(chat.messages, chat.tools)
        max_tokens = _max_tokens(a, len(prompt), chat.sampling.max_tokens)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(f"the request body is not valid JSON: {e}", 400, "invalid_json")
    except RequestError as e:
        return web.json_response(e.body(), status=e.status)
    s = chat.sampling
    request_id = f"anchor-{next(a.ids)}"
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, stop_token_ids=a.stop_ids, seed=s.seed
        )
        token_ids, finish = await _generate(a, GenerateRequest(request_id, tuple(prompt), params))
    except ValueError as e:
        return _error(f"the engine rejected the request: {e}", 400)
    except EngineError as e:
        return _error(f"engine failure: {e}", 503, "engine_unavailable")
    text = a.tok.decode([t for t in token_ids if t not in a.stop_ids])
    if s.stop and (cut := find_stop(text, s.stop)) >= 0:
        text, finish = text[:cut], "stop"
    return web.json_response(
        {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": a.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(token_ids),
                "total_tokens": len(prompt) + len(token_ids),
            },
        }
    )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _generate(a: Anchor, request: GenerateRequest) -> tuple[list[int], str]:
    """The engine's token ids and finish reason; ValueError for a request the engine rejects."""
    ids: list[int] = []
    async for item in a.engine.stream_batches(request):
        if isinstance(item, Finished):
            return ids, str(item.reason)
        ids.extend(item.token_ids)
    raise EngineError("the engine stream ended without a finish")


async def serve(engine_url: str, host: str, port: int, model_name: str) -> None:
    tok = default_tokenizer()
    engine = HTTPEngine(engine_url, token=os.environ.get(ENGINE_TOKEN_ENV) or None)
    runner = None
    try:
        max_context = (await engine.stats()).max_context
        anchor = Anchor(
            engine,
            model_name,
            tok,
            max_context,
            tuple(dict.fromkeys((tok.im_end_id, tok.eos_token_id))),
            itertools.count(),
        )
        app = web.Application(client_max_size=8 << 20)
        app[ANCHOR_KEY] = anchor
        app.add_routes(
            [
                web.post("/s/{session_id}/v1/chat/completions", chat_completions),
                web.post("/v1/chat/completions", chat_completions),
                web.get("/health", health),
            ]
        )
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)  # as the manager's
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        await engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-url", required=True, help="a running engine server (python -m reference engine)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--model-name", default="seamlessflow-tiny")
    args = ap.parse_args()
    asyncio.run(serve(args.engine_url, args.host, args.port, args.model_name))


if __name__ == "__main__":
    main()
