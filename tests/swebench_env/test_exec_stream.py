"""The exec stream reader (`swebench_env.exec_stream.pump`) on a socket pair standing in for the daemon's stream."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from swebench_env import exec_stream
from swebench_env.exec_stream import Output, pump


def frame(payload: bytes, stream: int = 1) -> bytes:
    return bytes([stream, 0, 0, 0]) + len(payload).to_bytes(4, "big") + payload


@pytest.fixture
def fast_poll(monkeypatch):
    monkeypatch.setattr(exec_stream, "POLL_S", 0.05)


def test_output_the_daemon_copies_after_the_command_ended_is_kept(fast_poll, monkeypatch):
    """The daemon says the command ended before it has copied the last of its output: what arrives after that,
    until the stream ends, is read, not cut off."""
    monkeypatch.setattr(exec_stream, "DRAIN_QUIET_S", 30.0)  # the stream's end, not a timer, ends the read
    ours, daemon = socket.socketpair()
    asked = threading.Event()

    def finished() -> bool:
        asked.set()
        return True

    def copy_late() -> None:
        daemon.sendall(frame(b">>>>> Start Test Output\n"))
        assert asked.wait(30)  # the reader has heard that the command ended
        time.sleep(0.3)  # the daemon's copy lags behind the command's end
        daemon.sendall(frame(b"1 passed\n") + frame(b">>>>> End Test Output\n", stream=2))
        daemon.close()

    writer = threading.Thread(target=copy_late)
    writer.start()
    out = Output(1 << 16)
    try:
        assert pump(ours, out, finished, time.monotonic() + 60, 5) is True
    finally:
        writer.join(30)
        ours.close()
    assert out.text() == ">>>>> Start Test Output\n1 passed\n>>>>> End Test Output\n"


def test_a_silent_process_holding_the_stream_does_not_hold_the_reader(fast_poll, monkeypatch):
    """Something the command started keeps the stream open and writes nothing: the reader stops once the
    command has ended and the stream stayed silent DRAIN_QUIET_S, well before the client's deadline."""
    monkeypatch.setattr(exec_stream, "DRAIN_QUIET_S", 0.2)
    ours, daemon = socket.socketpair()
    daemon.sendall(frame(b"started\n"))
    out = Output(1 << 16)
    start = time.monotonic()
    try:
        assert pump(ours, out, lambda: True, start + 120, 5) is True
    finally:
        ours.close()
        daemon.close()
    assert out.text() == "started\n" and time.monotonic() - start < 60


def test_a_process_that_keeps_writing_after_the_command_ended_is_read_at_most_drain_max_s(fast_poll, monkeypatch):
    monkeypatch.setattr(exec_stream, "DRAIN_MAX_S", 0.5)
    ours, daemon = socket.socketpair()
    asked, stop = threading.Event(), threading.Event()

    def finished() -> bool:
        asked.set()
        return True

    def chatter() -> None:  # silent until the reader has heard that the command ended, then never silent
        assert asked.wait(30)
        while not stop.is_set():
            daemon.sendall(frame(b"."))
            time.sleep(0.01)

    writer = threading.Thread(target=chatter)
    writer.start()
    start = time.monotonic()
    try:
        assert pump(ours, Output(1 << 16), finished, start + 120, 5) is True
        assert time.monotonic() - start < 60  # the cap ended it, not the client's deadline
    finally:
        stop.set()
        writer.join(30)
        ours.close()
        daemon.close()
