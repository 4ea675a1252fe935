"""Listening sockets for the project's HTTP servers (an engine's, the trajectory manager's).

`listen_sockets` binds before anything slow starts (a model load, an engine process), so that a port in use, a
port out of range or a host that is not this machine's is one clear `UserError` at once, and nothing can take the
port meanwhile; `serve_on` then serves an aiohttp runner on them, and `bound_port` tells which port port 0 got.
"""

from __future__ import annotations

import errno
import socket

from aiohttp import web

from core.errors import UserError


async def serve_on(runner: web.AppRunner, sockets: list[socket.socket], backlog: int = 128) -> web.AppRunner:
    """Set up `runner` and serve it on listening `sockets`, which it then owns (its cleanup closes them)."""
    try:
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock, backlog=backlog).start()
    except BaseException:
        await runner.cleanup()
        for sock in sockets:
            sock.close()
        raise
    return runner


def listen_sockets(host: str, port: int, backlog: int = 128) -> list[socket.socket]:
    """Listening TCP sockets on every address `host` resolves to (as asyncio's `create_server` binds them),
    for a server to take over with `serve_on`. Binding first, before a model loads or an engine starts, makes
    a port in use, a port out of range or a host that is not this machine's one clear `UserError` at once;
    and nothing can take the port between that check and the serving. Connections that arrive before the
    server starts wait in the kernel's queue."""
    if not 0 <= port <= 65535:
        raise UserError(f"cannot listen on port {port}: a port is 0-65535 (0 picks any free one)")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(
            f"cannot listen on host {host!r}: the name does not resolve ({getattr(e, 'strerror', e)}); "
            f"use an address of this machine: 127.0.0.1 (this machine only) or 0.0.0.0 (every "
            f"interface)"
        ) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio: restart despite TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio: "::" is IPv6 only
            if port == 0 and len(sockets) > 1:  # every address on the port the first one was given
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(backlog)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise UserError(_listen_error(host, port, e)) from None
    return sockets


def _listen_error(host: str, port: int, e: OSError) -> str:
    where = f"{f'[{host}]' if ':' in host else host}:{port}"
    if e.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on {where}: the port is in use (another server, or an earlier run still going?); "
            f"choose another --port, or 0 for any free one"
        )
    if e.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot listen on {where}: {host!r} is not an address of this machine; use 127.0.0.1 (this "
            f"machine only) or 0.0.0.0 (every interface)"
        )
    if e.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied (ports below 1024 need privileges); choose 1024-65535"
    return f"cannot listen on {where}: {e.strerror or e}"


def bound_port(runner: web.AppRunner) -> int:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return server.sockets[0].getsockname()[1]
    raise RuntimeError("the server has no bound socket")
