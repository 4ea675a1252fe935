"""The trajectory manager's endpoints beyond the agents' own: trajectories, control and observability.

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

A control call's refusal is a 4xx naming what was wrong (409 for a state conflict). Trees are serialised in
slices off the event loop (`dumps_in_slices`), so a huge one never stalls the agents' requests.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from reference.manager.access import MANAGER_KEY
from reference.manager.bodies import read_json
from reference.manager.chat import RequestError


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
    body, _ = await read_json(request)
    author = f"{request.remote} {request.headers.get('User-Agent', '')[:80]}".strip()
    return web.json_response({"session_id": sid, "annotations": await manager.annotate(sid, body, author)})


async def _admin_body(request: web.Request) -> dict:
    """A control call's JSON object ({} for an empty body)."""
    if not request.can_read_body:
        return {}
    body, _ = await read_json(request)
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


def routes() -> list[web.RouteDef]:
    """The trajectory, control and observability endpoints."""
    return [
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
