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
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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


# ---- refusing on arrival while saturated ----

MODEL = "seamlessflow-tiny"


def _call(netloc: str, path: str, body: dict | None = None, method: str = "POST", extra: str = "") -> bytes:
    """One whole HTTP/1.1 request as bytes; `extra`: header lines, each ending in CRLF."""
    data = json.dumps(body).encode() if body is not None else b""
    length = f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n" if data else ""
    return f"{method} {path} HTTP/1.1\r\nHost: {netloc}\r\n{length}{extra}\r\n".encode() + data


def _chat(netloc: str, session: str, extra: str = "") -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return _call(netloc, f"/s/{session}/v1/chat/completions", body, extra=extra)


def _answer(reader) -> tuple[int, dict[str, str], dict]:
    """(status, headers in lower case, JSON body) of the next response on a connection's reader."""
    status = int(reader.readline().split(b" ")[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, json.loads(reader.read(int(headers["content-length"])))


@contextmanager
def _saturated(fake_manager, http, wait_for, cap: int):
    """A manager whose `cap` in-flight slots are held by paused requests; yields (manager, the held futures), and
    resumes it after."""
    config = ManagerConfig(max_in_flight_requests=cap, max_loop_lag_s=0, default_max_tokens=8)
    m, _ = fake_manager(config=config, reply_tokens=4)
    m.call(m.manager.pause())
    body = {"model": MODEL, "messages": [{"role": "user", "content": "wait"}]}
    with ThreadPoolExecutor(cap) as pool:
        held = [pool.submit(http, "POST", f"{m.base_url(f'held{i}')}/chat/completions", body) for i in range(cap)]
        try:
            wait_for(lambda: m.manager.in_flight == cap, what=f"{cap} requests in flight")
            yield m, held
        finally:
            m.call(m.manager.resume())


def test_a_saturated_manager_refuses_agent_calls_on_arrival_and_keeps_answering_health_and_admin(
    fake_manager, http, wait_for
):
    with _saturated(fake_manager, http, wait_for, cap=2) as (m, held):
        netloc = urlsplit(m.url).netloc
        with _connect(m.url) as sock, sock.makefile("rb") as reader:
            sock.sendall(_chat(netloc, "a"))
            status, headers, err = _answer(reader)
            assert status == 429 and headers["retry-after"] == "1" and "connection" not in headers, headers
            assert err["error"]["code"] == "overloaded" and "limit of 2 requests in flight" in err["error"]["message"]
            completion = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            # kept alive: two more requests in one segment, answered in order
            sock.sendall(_call(netloc, "/s/b/v1/completions", completion) + _call(netloc, "/health", method="GET"))
            assert _answer(reader)[0] == 429
            status, _, report = _answer(reader)
            assert status == 200 and report["status"] == "degraded", report
            assert any(r.startswith("admission saturated: 2 requests in flight") for r in report["reasons"]), report
        status, stats = http("GET", f"{m.url}/stats")
        assert status == 200 and stats["shed_on_arrival"] == 2 and stats["shed"] == 2, stats
        assert http("GET", f"{m.url}/trajectories")[0] == 200
        with _connect(m.url) as sock, sock.makefile("rb") as reader:  # the client asks to close
            sock.sendall(_chat(netloc, "c", extra="Connection: close\r\n"))
            status, headers, _ = _answer(reader)
            assert status == 429 and headers["connection"] == "close", headers
            assert reader.read() == b""  # closed after the answer
        assert m.manager.shed_on_arrival == 3
    assert [f.result(timeout=60)[0] for f in held] == [200, 200]
    with _connect(m.url) as sock, sock.makefile("rb") as reader:  # room again: a new connection is served
        sock.sendall(_chat(netloc, "a"))
        status, _, body = _answer(reader)
    assert status == 200 and body["choices"][0]["message"]["content"] is not None, body


def test_requests_admitted_before_saturation_complete_and_refused_ones_leave_nothing(fake_manager, http, wait_for):
    with _saturated(fake_manager, http, wait_for, cap=4) as (m, held):
        netloc = urlsplit(m.url).netloc
        with _connect(m.url) as sock, sock.makefile("rb") as reader:
            sock.sendall(b"".join(_chat(netloc, f"refused{i}") for i in range(20)))  # pipelined
            assert [_answer(reader)[0] for _ in range(20)] == [429] * 20
        assert m.manager.shed_on_arrival == 20 and m.manager.in_flight == 4
    assert [f.result(timeout=60)[0] for f in held] == [200] * 4
    sessions = http("GET", f"{m.url}/trajectories")[1]["sessions"]
    assert sorted(sessions) == [f"held{i}" for i in range(4)], sessions
    assert (m.manager.in_flight, m.manager.arriving, m.manager.body_bytes) == (0, 0, 0)


def test_requests_queued_on_a_connection_count_as_arriving_until_handled_or_dropped(fake_manager, http, wait_for):
    """Agent calls parsed but not yet handed to a handler count towards the limit (a burst that arrives in one turn
    of the event loop is refused on arrival beyond it); a connection closed with calls queued gives them back."""
    config = ManagerConfig(max_in_flight_requests=3, max_loop_lag_s=0, default_max_tokens=8)
    m, _ = fake_manager(config=config, reply_tokens=4)
    m.call(m.manager.pause())
    netloc = urlsplit(m.url).netloc
    try:
        with _connect(m.url) as sock:
            sock.sendall(b"".join(_chat(netloc, f"p{i}") for i in range(3)))  # one handled at a time, in order
            wait_for(lambda: (m.manager.in_flight, m.manager.arriving) == (1, 2), what="one in flight, two queued")
            with _connect(m.url) as other, other.makefile("rb") as reader:
                other.sendall(_chat(netloc, "other"))
                assert _answer(reader)[0] == 429 and m.manager.shed_on_arrival == 1
        wait_for(lambda: (m.manager.in_flight, m.manager.arriving) == (0, 0), what="the closed connection's calls gone")
    finally:
        m.call(m.manager.resume())
    hi = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert http("POST", f"{m.base_url('after')}/chat/completions", hi)[0] == 200


def test_an_openai_client_that_retries_gets_through_once_there_is_room(fake_manager, http, wait_for):
    import openai

    with _saturated(fake_manager, http, wait_for, cap=1) as (m, held):
        client = openai.OpenAI(base_url=m.base_url("patient"), api_key="none", max_retries=8, timeout=60)
        with client, ThreadPoolExecutor(1) as pool:
            messages = [{"role": "user", "content": "hi"}]
            call = pool.submit(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=4)
            wait_for(lambda: m.manager.shed_on_arrival >= 1, what="the client's first try refused")
            m.call(m.manager.resume())
            reply = call.result(timeout=120)
    assert reply.choices[0].message.content is not None and held[0].result(timeout=60)[0] == 200


def test_what_cannot_be_refused_on_arrival_takes_the_ordinary_path(fake_manager, http, wait_for):
    """A body not all in, HTTP/1.0 and a request aiohttp cannot parse are answered by the handlers (a body is
    read to its end, and the connection kept), and the next whole request on it is refused on arrival again."""
    with _saturated(fake_manager, http, wait_for, cap=1) as (m, _):
        netloc = urlsplit(m.url).netloc
        with _connect(m.url) as sock, sock.makefile("rb") as reader:
            whole = _chat(netloc, "split")
            sock.sendall(whole[:-10])  # the body's last bytes still to come
            assert _answer(reader)[0] == 429
            assert (m.manager.shed, m.manager.shed_on_arrival) == (1, 0)
            sock.sendall(whole[-10:])  # read to its end, not taken for a request
            sock.sendall(_call(netloc, "/health", method="GET"))
            assert _answer(reader)[0] == 200
            sock.sendall(_chat(netloc, "next"))
            assert _answer(reader)[0] == 429
            assert (m.manager.shed, m.manager.shed_on_arrival) == (2, 1)
        old = _chat(netloc, "old").replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        smuggled = _chat(netloc, "te", extra="Transfer-Encoding: chunked\r\n")  # and a Content-Length
        for request, status in ((old, 429), (smuggled, 400)):
            with _connect(m.url) as sock, sock.makefile("rb") as reader:
                sock.sendall(request)
                assert _answer(reader)[0] == status
        assert (m.manager.shed, m.manager.shed_on_arrival) == (3, 1)
