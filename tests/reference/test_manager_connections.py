"""Connection hygiene of the trajectory manager: half-sent requests and idle connections close after
`idle_timeout_s`, headers are bounded, and at an open-file limit of 1,024 a thousand idle sockets neither keep
`/health` from answering nor flood the log: the oldest idle connection makes room, and `/health` says the
server is saturated."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlsplit

import pytest

from reference.manager.manager import ManagerConfig


def _connect(url: str) -> socket.socket:
    where = urlsplit(url)
    return socket.create_connection((where.hostname, where.port), timeout=30)


def test_a_half_sent_request_is_closed_after_the_idle_timeout(fake_manager, http):
    m, _ = fake_manager(config=ManagerConfig(default_max_tokens=8, idle_timeout_s=1.0), reply_tokens=4)
    sock = _connect(m.url)
    try:
        sock.sendall(f"POST /s/a/v1/chat/completions HTTP/1.1\r\nHost: {urlsplit(m.url).netloc}\r\nX-Slow: ".encode())
        start = time.monotonic()
        assert sock.recv(4096) == b""  # closed by the server, not answered
        assert time.monotonic() - start < 20
    finally:
        sock.close()
    assert http("GET", f"{m.url}/health")[0] == 200


def test_headers_are_bounded(fake_manager):
    m, _ = fake_manager(reply_tokens=4)
    many = "".join(f"X-H{i}: {'v' * 100}\r\n" for i in range(100))  # 100 headers: over the 64 allowed
    sock = _connect(m.url)
    try:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {urlsplit(m.url).netloc}\r\n{many}\r\n".encode())
        answer = sock.recv(4096)
    finally:
        sock.close()
    assert answer.split(b" ")[1] == b"400" and b"Too many headers" in answer, answer[:200]


def _health(url: str, timeout_s: float) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_a_thousand_idle_sockets_at_a_limit_of_1024_do_not_stop_health(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"this test opens 1,100 sockets; the hard open-file limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))  # this process holds the sockets
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "reference", "serve", "--backend", "fake", "--port", str(port), "--store",
         str(tmp_path / "t.sqlite")], stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)),
    )  # fmt: skip
    sockets: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if _health(url, 1)[0] == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, "serve did not start"
                time.sleep(0.2)
        for _ in range(1100):
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        status, report = _health(url, 10)  # the server makes room by closing its oldest idle connections
        assert status == 200, report
        assert report["status"] == "degraded" and any("connections open at a limit of" in r for r in report["reasons"])
        assert proc.poll() is None
    finally:
        for sock in sockets:
            sock.close()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert (tmp_path / "serve.log").stat().st_size < 200_000  # no flood of accept() tracebacks
