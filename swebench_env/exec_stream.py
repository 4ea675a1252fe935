"""A `docker exec`'s streams, as a sandbox reads and writes them: Docker multiplexes an exec's stdout and stderr
as frames (`_unframe`); the payload is kept bounded (`Output`: the first and last halves, with a count of what
was dropped), read until the stream ends or, when something the command started holds it open, until the
daemon says the command has ended (`pump`, asking every `POLL_S` of silence) and what it still copies has arrived
(`DRAIN_QUIET_S` of silence, at most `DRAIN_MAX_S`), and in any case no longer than the client's deadline. The
daemon can report the command ended before it has copied the last of its output; when the reader stopped 50 ms
after the end, a graded run beside a CPU hog once came back without its test log's end marker ("no test output"),
and the daemon's log showed writes to exec streams the client had closed ("broken pipe"). `send` writes a tar to
an exec's stdin (`Sandbox.put_archive`).
"""

from __future__ import annotations

import select
import socket
import time

POLL_S = 1.0  # with no output for this long, ask the daemon whether the command has ended
DRAIN_QUIET_S = 2.0  # once it has ended: read on until the stream ends or is silent this long (see above)
DRAIN_MAX_S = 10.0  # and no longer than this (something the command started keeps writing)
PUT_TIMEOUT_S = 600.0  # copying files in (`put_archive`) gives up after this long


class Output:
    """At most `limit` bytes of a stream: its first half and its last half, and how much was dropped."""

    def __init__(self, limit: int) -> None:
        self.head_max, self.tail_max = limit // 2, limit - limit // 2
        self.head, self.tail = bytearray(), bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_max - len(self.head)
        self.head += data[:room]
        self.tail += data[room:] if room > 0 else data
        if len(self.tail) > 2 * self.tail_max:  # trim in batches, not on every chunk
            self._trim()

    def _trim(self) -> None:
        extra = len(self.tail) - self.tail_max
        if extra > 0:
            del self.tail[:extra]
            self.dropped += extra

    def text(self) -> str:
        self._trim()
        gap = f"\n[... {self.dropped} bytes of output left out ...]\n".encode() if self.dropped else b""
        return bytes(self.head + gap + self.tail).decode("utf-8", errors="replace")


def pump(sock, out: Output, finished, deadline: float, grace_s: float) -> bool:
    """Feed the exec stream's payload into `out` until it ends (True), or until the client's deadline
    (`deadline` + `grace_s`, the sandbox's `client_grace_s`) passes with the command still running (False)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    frames, give_up = bytearray(), deadline + grace_s
    while (left := give_up - time.monotonic()) > 0:
        if not poller.poll(min(POLL_S, left) * 1000):
            if finished():  # the command has ended, but a process it started holds the stream open
                _drain(sock, poller, frames, out)
                return True
            continue
        data = _recv(sock)
        if not data:
            return True
        frames += data
        _unframe(frames, out)
    return finished()


def send(sock, stream, out: Output) -> None:
    """Write `stream` to an exec's stdin, close it, and read the exec's output into `out` until it ends."""
    raw = getattr(sock, "_sock", sock)
    raw.settimeout(PUT_TIMEOUT_S)
    while chunk := stream.read(1 << 20):
        raw.sendall(chunk)
    raw.shutdown(socket.SHUT_WR)
    frames = bytearray()
    while data := raw.recv(65536):
        frames += data
        _unframe(frames, out)


def _drain(sock, poller, frames: bytearray, out: Output) -> None:
    """After the command ended: what the daemon still copies, until the stream ends or falls silent."""
    give_up = time.monotonic() + DRAIN_MAX_S
    while (left := give_up - time.monotonic()) > 0 and poller.poll(min(DRAIN_QUIET_S, left) * 1000):
        if not (data := _recv(sock)):
            return
        frames += data
        _unframe(frames, out)


def _unframe(frames: bytearray, out: Output) -> None:
    """Move the payload of every complete frame to `out`. Docker multiplexes an exec's stdout and
    stderr as frames: 1 byte stream id, 3 zero bytes, 4 bytes big-endian payload length, payload."""
    while len(frames) >= 8:
        size = int.from_bytes(frames[4:8], "big")
        if len(frames) < 8 + size:
            return
        out.add(bytes(frames[8 : 8 + size]))
        del frames[: 8 + size]


def _recv(sock) -> bytes:
    try:
        return sock.recv(65536) if hasattr(sock, "recv") else (sock.read(65536) or b"")
    except OSError:
        return b""


def close_socket(sock) -> None:
    for s in (sock, getattr(sock, "_sock", None)):  # SocketIO over a unix socket: close both
        if s is not None:
            try:
                s.close()
            except OSError:
                pass


def exit_status(api, exec_id: str, timeout_s: float = 10.0) -> int | None:
    """The exec's exit status; None if it is still running `timeout_s` after its stream ended."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        info = api.exec_inspect(exec_id)
        if not info["Running"] and info["ExitCode"] is not None:
            return int(info["ExitCode"])
        if time.monotonic() > deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
