"""A lean HTTP/1.1 client for load generation: pre-built request bytes over keep-alive connections.

An open-loop load generator that shares a core with the engine must cost much less per request than
the server it loads; aiohttp's client costs about as much as a small aiohttp server. This one is an
`asyncio.Protocol` that writes request bytes built beforehand and reads back only the status line,
the headers it needs and the body's length (Content-Length or chunked). One request at a time per
connection; idle connections are reused, new ones opened when none is idle (as a crowd of clients
would). A request that times out closes its connection.
"""

from __future__ import annotations

import asyncio


def request_bytes(method: str, host: str, port: int, path: str, body: bytes = b"", headers: str = "") -> bytes:
    """A whole HTTP/1.1 request; `headers`: extra header lines, each ending in CRLF."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{headers}"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is not None and not self.waiter.done():
            if (done := _parse_response(self.buffer)) is not None:
                status, keep_alive, body_start, size = done
                body = bytes(self.buffer[body_start:size])
                del self.buffer[:size]
                self.waiter.set_result((status, keep_alive, body))

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError("the server closed the connection"))

    async def exchange(self, data: bytes) -> tuple[int, bool, bytes]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _parse_response(buf: bytearray) -> tuple[int, bool, int, int] | None:
    """(status, keep-alive, where the body starts, where it ends) of the complete response at the start
    of `buf`, or None while it is incomplete. A chunked body is left chunked."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).lower()
    status = int(head[9:12])
    keep_alive = b"\r\nconnection: close" not in head
    at = head.find(b"\r\ncontent-length:")
    if at >= 0:
        line_end = head.find(b"\r\n", at + 2)
        size = end + 4 + int(head[at + 17 : line_end if line_end >= 0 else len(head)])
        return (status, keep_alive, end + 4, size) if len(buf) >= size else None
    if b"\r\ntransfer-encoding: chunked" in head:
        pos = end + 4
        while (line_end := buf.find(b"\r\n", pos)) >= 0:
            size = int(bytes(buf[pos:line_end]).split(b";")[0], 16)
            pos = line_end + 2 + size + 2
            if size == 0:
                return (status, keep_alive, end + 4, pos) if len(buf) >= pos else None
        return None
    return status, False, end + 4, end + 4  # no body length: the body runs to the close (not read)


class LeanClient:
    """Requests to one server; `send` returns the status, or "timeout" / "error"; `fetch` the body too."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[_Connection] = []
        self.opened = 0  # connections opened so far

    async def send(self, data: bytes, timeout_s: float) -> int | str:
        return (await self.fetch(data, timeout_s))[0]

    async def fetch(self, data: bytes, timeout_s: float) -> tuple[int | str, bytes]:
        conn = None
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self._connection()
                status, keep_alive, body = await conn.exchange(data)
        except TimeoutError:
            if conn is not None:
                conn.close()
            return "timeout", b""
        except OSError:  # refused, reset
            if conn is not None:
                conn.close()
            return "error", b""
        if keep_alive and not conn.closed:
            self.idle.append(conn)
        else:
            conn.close()
        return status, body

    async def _connection(self) -> _Connection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
        self.opened += 1
        return conn

    async def warm(self, n: int, batch: int = 64) -> None:
        """Open `n` idle connections, `batch` at a time: a burst beyond the server's listen backlog (128 for
        aiohttp) loses SYNs, which the kernel retries a second later."""
        loop = asyncio.get_running_loop()
        while len(self.idle) < n:
            k = min(batch, n - len(self.idle))
            made = await asyncio.gather(*(loop.create_connection(_Connection, self.host, self.port) for _ in range(k)))
            self.idle += [conn for _, conn in made]
            self.opened += k

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()
