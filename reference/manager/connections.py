"""The trajectory manager's connections: counted, capped by the open-file limit, answered in JSON even when
aiohttp rejects a request before any handler runs, and refused cheaply while admission is saturated.

Past the manager's `max_connections` (what the open-file limit leaves) the oldest connection with no request
under way is closed to make room. A connection with no request under way closes after `idle_timeout_s`;
request lines and headers are bounded (`MAX_LINE_BYTES`, `MAX_HEADERS`). Running out of file descriptors is
logged once every 10 s, not once a connection.

While the in-flight limit is reached, an agent request that arrives whole on an idle connection is answered
429 from the connection itself, as soon as aiohttp's parser (C) has read it: no request object, routing,
middleware, handler or response object, a fifth to a third of what a 429 costs through them, so refusing
several times what the manager can serve leaves it most of its core. The parser has consumed the request, body
included, so the connection stays at a message boundary and is kept alive (unless the client asked to close);
anything else (a request under way or queued before it on the connection, a body not all in, HTTP/1.0, an
upgrade, any other endpoint: /health, /stats and the admin calls) takes the ordinary path, whose handlers
check the limit again. Agent calls parsed but not yet handed to a handler count towards the limit
(`arriving`), so a burst that arrives in one turn of the event loop is refused as it arrives beyond it; one
connection adds at most aiohttp's queue of 32 pipelined requests. Not reading at all while saturated (as a
server that stops accepting does) would turn shedding back into queueing: clients that give up leave requests
behind in the kernel that are served for nobody, and OpenAI clients wait out their timeout instead of
retrying after `Retry-After`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import time
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import HttpVersion11, web
from aiohttp.web_protocol import RequestHandler

from reference.manager.access import MANAGER_KEY, error_response
from reference.manager.admission import overloaded
from reference.manager.manager import TrajectoryManager

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 16 << 10  # the request line, and each header
MAX_HEADERS = 64  # header lines a request: with MAX_LINE_BYTES, at most 1 MiB of headers buffered a connection
FD_RESERVE = 128  # open files kept free beyond the connections: the store, engines' sockets, /health's connection
ACCEPT_BATCH = 32  # connections asyncio accepts in one go (its `backlog`): room is made for them before the next
LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (aiohttp's default of 128 drops bursts)
# The parts of aiohttp's connection handler that refusing on arrival uses (aiohttp 3.14 has them); with an aiohttp
# that lacks one, every refusal takes the ordinary path.
_ON_ARRIVAL = {"_waiter", "_max_msg_queue_size", "_next_keepalive_close_time"} <= set(
    getattr(RequestHandler, "__slots__", ())
)
AGENT_CALL = re.compile(r"/s/[^/?#]+/v1/(?:chat/)?completions(?:[?#]|$)")  # the request targets refused on arrival


class _OnArrival:
    """aiohttp's request parser, with what it has just parsed passed through `_Protocol.arrived` (agent calls
    counted, or refused on the spot while admission is saturated) before aiohttp queues it for a handler."""

    __slots__ = ("parser", "protocol")

    def __init__(self, parser, protocol: _Protocol) -> None:
        self.parser, self.protocol = parser, protocol

    def feed_data(self, data: bytes):
        messages, upgraded, tail = self.parser.feed_data(data)
        return (self.protocol.arrived(messages) if messages else messages), upgraded, tail

    def __getattr__(self, name: str):
        return getattr(self.parser, name)


def _agent_call(message) -> bool:
    """A POST to an agent endpoint (a request aiohttp could not parse comes as an error record without a
    method)."""
    return getattr(message, "method", None) == "POST" and AGENT_CALL.match(message.path) is not None


def _refusable(message, payload) -> bool:
    """An agent call whose body is all in, HTTP/1.1, not an upgrade: once refused, the connection is at a message
    boundary."""
    return _agent_call(message) and message.version == HttpVersion11 and not message.upgrade and payload.is_eof()


@functools.lru_cache(maxsize=64)
def _overload_answer(message: str, second: int, close: bool) -> bytes:
    """The whole HTTP response refusing an agent request for overload, as the handlers answer it."""
    error = overloaded(message)
    body = json.dumps(error.body()).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (error.headers or {}).items())
    head = (
        f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Date: {formatdate(second, usegmt=True)}\r\n"
    )
    return (head + ("Connection: close\r\n\r\n" if close else "\r\n")).encode() + body


class _Protocol(RequestHandler):
    """What aiohttp rejects before any handler runs (an over-long request line, a malformed header or
    method) is answered with the same OpenAI-style JSON error as everything else. Connections are counted;
    past the manager's `max_connections` the oldest with no request under way (idle, or its headers not all
    in) is closed to make room, else the new one. While admission is saturated, agent requests are refused as
    they arrive (the module docstring)."""

    def __init__(self, manager: _Server, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self.arriving = 0  # agent calls queued here, not yet handed to a handler (of the manager's `arriving`)
        if _ON_ARRIVAL:
            self._parser = _OnArrival(self._parser, self)
            self._make_request, self._request_factory = self._request_factory, self._request_made

    def arrived(self, messages: list) -> list:
        """The parsed `messages` left for aiohttp to queue, their agent calls counted as arriving. While admission is
        saturated, the agent calls at their head are answered 429 here if that can be done cheaply and correctly:
        on an idle connection (aiohttp waiting for a request: no answer is owed before these) when the parser did
        not pause for a full queue (it keeps the rest until the queue drains)."""
        manager = self._manager.manager
        if manager.saturated:
            waiter = self._waiter
            if waiter is not None and not waiter.done() and len(messages) < self._max_msg_queue_size:
                messages = self._refuse_on_arrival(messages, manager)
        if calls := sum(1 for message, _ in messages if _agent_call(message)):
            self.arriving += calls
            manager.arriving += calls
        return messages

    def _refuse_on_arrival(self, messages: list, manager: TrajectoryManager) -> list:
        for i, (message, payload) in enumerate(messages):
            if not _refusable(message, payload):
                return messages[i:]
            self._parser.message_consumed()
            manager.shed += 1
            manager.shed_on_arrival += 1
            close = bool(message.should_close)
            self.transport.write(_overload_answer(manager.overload_message(), int(time.time()), close))
            if close:
                self.force_close()  # once the answer is written
                return []
        self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout  # it is not idle
        return []

    def _request_made(self, message, *args) -> web.BaseRequest:
        """aiohttp's request factory, for a message it takes from the queue to handle: no longer arriving."""
        if _agent_call(message):
            self.arriving -= 1
            self._manager.manager.arriving -= 1
        return self._make_request(message, *args)

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
        manager = self._manager.manager
        manager.connections -= 1
        manager.arriving -= self.arriving  # queued here, never to be handled
        self.arriving = 0
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response was already sent
        text = "internal server error" if status >= 500 else (message or HTTPStatus(status).phrase)
        response = error_response(status, text.splitlines()[0][:300] if text else HTTPStatus(status).phrase)
        response.force_close()
        return response


class _Server(web.Server):
    manager: TrajectoryManager

    def __call__(self) -> RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """An AppRunner whose server's connections are `_Protocol`s: counted, JSON errors from aiohttp, refusals on
    arrival."""

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


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
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
