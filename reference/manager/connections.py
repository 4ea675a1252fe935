"""The trajectory manager's connections: counted, capped by the open-file limit, and answered in JSON even
when aiohttp rejects a request before any handler runs.

Past the manager's `max_connections` (what the open-file limit leaves) the oldest connection with no request
under way is closed to make room. A connection with no request under way closes after `idle_timeout_s`;
request lines and headers are bounded (`MAX_LINE_BYTES`, `MAX_HEADERS`). Running out of file descriptors is
logged once every 10 s, not once a connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from reference.manager.access import MANAGER_KEY, error_response
from reference.manager.manager import TrajectoryManager

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 16 << 10  # the request line, and each header
MAX_HEADERS = 64  # header lines a request: with MAX_LINE_BYTES, at most 1 MiB of headers buffered a connection
FD_RESERVE = 128  # open files kept free beyond the connections: the store, engines' sockets, /health's connection
ACCEPT_BATCH = 32  # connections asyncio accepts in one go (its `backlog`): room is made for them before the next
LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (aiohttp's default of 128 drops bursts)


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
        response = error_response(status, text.splitlines()[0][:300] if text else HTTPStatus(status).phrase)
        response.force_close()
        return response


class _Server(web.Server):
    manager: TrajectoryManager

    def __call__(self) -> RequestHandler:
        return _JSONErrors(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
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
