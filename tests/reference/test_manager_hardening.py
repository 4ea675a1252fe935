"""The trajectory manager under hostile input and operator mistakes: each test is one finding of an audit.

Store failures (a full disk, files deleted while serving, another process holding the write lock), the
event loop blocked by one huge request, memory kept for rejected requests, access control, bad input
that used to get a 500 or be accepted, overload.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from reference.manager.admin import dumps_in_slices
from reference.manager.load import AdaptiveLimit
from reference.manager.manager import ManagerConfig
from reference.manager.store import TrajectoryStore

MODEL = "seamlessflow-tiny"


def say(text: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def raw(method: str, url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of an HTTP call with arbitrary bytes and headers."""
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null"), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), dict(e.headers)


# ---- the durable store ----


def test_a_failed_store_write_answers_503_and_the_session_goes_on_when_space_returns(fake_manager, http, tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    m, _ = fake_manager(store=store, reply_tokens=4)
    url = f"{m.base_url('disk')}/chat/completions"
    status, first = http("POST", url, say("hello"))
    assert status == 200, first
    history = [{"role": "user", "content": "hello"}, first["choices"][0]["message"]]
    store.set_max_bytes(1)  # the disk is full: no new page can be written
    long_turn = {"role": "user", "content": "words " * 1500}
    status, err = http("POST", url, {"model": MODEL, "messages": [*history, long_turn]})
    assert status == 503, err
    assert err["error"]["code"] == "store_unavailable" and "full" in err["error"]["message"]
    status, health = http("GET", f"{m.url}/health")
    assert status == 503 and health["status"] == "unhealthy", health
    store.set_max_bytes(None)  # space returns
    status, third = http("POST", url, {"model": MODEL, "messages": [*history, {"role": "user", "content": "again"}]})
    assert status == 200, third
    _, tree = http("GET", f"{m.url}/trajectories/disk")
    assert tree["num_branches"] == 1 and len(tree["branches"][0]["request_ids"]) == 2  # the failed turn left nothing
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # turn 3 extends turn 1 in the tree
    assert http("GET", f"{m.url}/health") == (200, {"ok": True, "status": "ok", "reasons": []})


def test_every_answered_request_survives_the_manager_being_killed_before_a_fold(tmp_path, monkeypatch):
    """A `serve` process answers requests (journaled, not yet folded into SQLite) and is SIGKILLed; the
    store opened afterwards folds the journal the dead process left: every answered request is there, in
    order, with trees that replay."""
    import signal

    from benchmarks.harness import engine_token, start_manager
    from reference.engine.fake import FakeConfig
    from reference.engine.process import EngineProcess, EngineSpec

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    engine = EngineProcess(EngineSpec(backend="fake", options=FakeConfig(reply_tokens=4)))
    try:
        manager = start_manager(engine.url, tmp_path, engine_token(engine))
        try:
            url = f"{manager.url}/s/killed/v1/chat/completions"
            answered, messages = [], []
            for turn in range(20):
                messages.append({"role": "user", "content": f"turn {turn}"})
                status, body, _ = raw("POST", url, json.dumps({"model": MODEL, "messages": messages}).encode())
                assert status == 200, body
                answered.append(body["trajectory"]["request_id"])
                messages.append(body["choices"][0]["message"])
            manager.proc.send_signal(signal.SIGKILL)  # at once: the last records are only in the journal
            manager.proc.wait(timeout=30)
        finally:
            manager.close()
    finally:
        engine.close()
    (path,) = tmp_path.glob("manager-*.sqlite")
    with TrajectoryStore(path) as store:
        assert [r.request_id for r in store.records("killed")] == answered
        tree = store.load_tree("killed")
    assert tree.to_json()["num_branches"] == 1  # each turn extends the last: one branch, nothing lost between
    assert list(tmp_path.glob("manager-*.sqlite-records-*")) == []


def test_a_full_disk_under_the_journal_answers_503_and_loses_nothing_answered(
    fake_manager, http, tmp_path, monkeypatch
):
    import reference.manager.journal as journal_module

    path = tmp_path / "t.sqlite"
    m, _ = fake_manager(store=path, reply_tokens=3)
    url = f"{m.base_url('full')}/chat/completions"
    status, first = http("POST", url, say("hello"))
    assert status == 200, first
    real_write = os.write

    def disk_full(fd, data):
        if fd == getattr(m.store._journal.segment, "fd", None):  # only the journal's writes find the disk full
            real_write(fd, data[:7])  # a torn frame (the store cuts it off)
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(journal_module.os, "write", disk_full)
    history = [{"role": "user", "content": "hello"}, first["choices"][0]["message"]]
    status, err = http("POST", url, {"model": MODEL, "messages": [*history, {"role": "user", "content": "more"}]})
    assert status == 503 and err["error"]["code"] == "store_unavailable", err
    assert "No space left on device" in err["error"]["message"]
    assert http("GET", f"{m.url}/health")[0] == 503
    monkeypatch.setattr(journal_module.os, "write", real_write)  # space returns
    status, third = http("POST", url, {"model": MODEL, "messages": [*history, {"role": "user", "content": "again"}]})
    assert status == 200, third
    assert http("GET", f"{m.url}/health")[0] == 200
    m.close()
    with TrajectoryStore(path) as store:  # both answered turns, nothing of the refused one
        assert [r.request_id for r in store.records("full")] == [
            first["trajectory"]["request_id"], third["trajectory"]["request_id"]]  # fmt: skip


def test_a_store_deleted_while_serving_is_noticed(fake_manager, http, tmp_path):
    path = tmp_path / "t.sqlite"
    m, _ = fake_manager(store=path, reply_tokens=3)
    assert http("POST", f"{m.base_url('a')}/chat/completions", say("one"))[0] == 200
    for p in tmp_path.glob("t.sqlite*"):
        p.unlink()
    status, health = http("GET", f"{m.url}/health")
    assert status == 503 and "was removed" in health["reasons"][0], health
    status, err = http("POST", f"{m.base_url('a')}/chat/completions", say("two"))
    assert status == 503 and "was removed" in err["error"]["message"], err


def test_another_process_holding_the_write_lock_does_not_freeze_the_server(wait_for, fake_manager, http, tmp_path):
    """Records are journaled, so requests keep being answered while another process holds SQLite's write
    lock; once a fold has waited past the busy timeout, the store is unhealthy and writes answer 503 until
    the lock is free, and then everything answered lands."""
    path = tmp_path / "t.sqlite"
    m, _ = fake_manager(store=TrajectoryStore(path, busy_timeout_s=1.0), reply_tokens=3)
    assert http("POST", f"{m.base_url('a')}/chat/completions", say("one"))[0] == 200
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process takes the write lock and keeps it
    try:
        assert http("POST", f"{m.base_url('b')}/chat/completions", say("two"))[0] == 200  # journaled, no wait
        wait_for(lambda: http("GET", f"{m.url}/health")[0] == 503, what="the fold to give up on the lock")
        assert http("GET", f"{m.url}/trajectories/a")[0] in (200, 503)  # answered, not frozen
        with ThreadPoolExecutor(1) as pool:
            blocked = pool.submit(http, "POST", f"{m.base_url('c')}/chat/completions", say("three"))
            wait_for(lambda: http("GET", f"{m.url}/stats")[1]["in_flight"] == 1, what="the request to start")
            assert http("GET", f"{m.url}/health")[0] == 503  # answered while the write waits for the lock
            status, err = blocked.result(timeout=60)
        assert status == 503 and "locked" in err["error"]["message"], err
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert http("POST", f"{m.base_url('d')}/chat/completions", say("four"))[0] == 200
    wait_for(lambda: http("GET", f"{m.url}/health")[0] == 200, what="the store to be healthy again")
    with TrajectoryStore(path) as store:
        assert sorted(store.sessions()) == ["a", "b", "d"]  # what was answered, folded; "c" left nothing


# ---- the event loop ----


def test_a_large_message_does_not_stall_other_clients(wait_for, fake_manager, http, monkeypatch):
    """A body over 64 KiB is parsed and tokenised off the event loop: /health answers while one is tokenised (a
    slow tokenisation stood in for by a second's sleep; a text too long for any context is refused unread)."""
    import threading

    from reference.manager.chat import ChatRenderer

    m, _ = fake_manager(reply_tokens=3)
    real, started = ChatRenderer.render_pending, threading.Event()

    def slow(self, *args):
        started.set()
        time.sleep(1.0)
        return real(self, *args)

    monkeypatch.setattr(ChatRenderer, "render_pending", slow)
    large = json.dumps(say("lorem ipsum dolor sit amet " * 4_000)).encode()  # 108 KB: tokenised off the loop
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(raw, "POST", f"{m.base_url('big')}/chat/completions", large,
                          {"Content-Type": "application/json"})  # fmt: skip
        assert started.wait(60), "the large request was not tokenised"
        status, _ = http("GET", f"{m.url}/health")
        answered_first = not big.done()  # /health came back while the large message was still being tokenised
        status_big, err, _ = big.result(timeout=120)
    assert status == 200
    assert answered_first
    assert status_big == 400 and err["error"]["code"] == "context_length_exceeded"


# ---- memory ----


def test_rejected_requests_keep_nothing(fake_manager, http):
    m, _ = fake_manager(reply_tokens=3)
    big = "x " * 450_000  # 0.9 MB: far over the context
    for i in range(10):
        status, err = http("POST", f"{m.base_url(f'r{i}')}/chat/completions", say(big))
        assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    stats = http("GET", f"{m.url}/stats")[1]
    assert (stats["sessions_in_memory"], stats["tokens_in_memory"]) == (0, 0)
    assert http("GET", f"{m.url}/trajectories")[1]["sessions"] == []


def test_a_text_far_over_the_context_is_refused_before_it_is_tokenised(fake_manager, http, monkeypatch):
    """Six 7 MiB messages at once took the manager to 6 GB: each was tokenised (seconds, a gigabyte) only to
    learn it was too long. A text with more characters than the context can hold tokens of the longest kind is
    now refused unread."""
    from reference.manager.chat import ChatRenderer

    m, _ = fake_manager(reply_tokens=3)
    tokenised = []
    real = ChatRenderer.render_pending
    monkeypatch.setattr(ChatRenderer, "render_pending", lambda self, *a: tokenised.append(1) or real(self, *a))
    huge = "word " * (7 * 2**20 // 5)  # 7 MiB
    status, err = http("POST", f"{m.base_url('huge')}/chat/completions", say(huge))
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert "characters are at least" in err["error"]["message"] and tokenised == []
    status, err = http("POST", f"{m.base_url('huge')}/completions", {"model": MODEL, "prompt": huge})
    assert status == 400 and "characters are at least" in err["error"]["message"]
    assert http("POST", f"{m.base_url('fine')}/chat/completions", say("word " * 20_000))[0] in (200, 400)
    assert tokenised == [1]  # a body that may fit is tokenised as before


def test_sessions_stay_within_the_memory_budget(fake_manager, openai_client, http):
    config = ManagerConfig(default_max_tokens=8, max_tokens_in_memory=400, max_session_tokens_in_memory=150)
    m, _ = fake_manager(config=config, reply_tokens=8)
    long_history = [{"role": "user", "content": "word " * 200}]  # one session larger than its budget
    status, _ = http("POST", f"{m.base_url('long')}/chat/completions", {"model": MODEL, "messages": long_history})
    assert status == 200
    assert "long" not in m.manager.sessions.ids()  # over its own budget: it left memory once idle
    for i in range(12):
        assert http("POST", f"{m.base_url(f's{i}')}/chat/completions", say(f"hello number {i}"))[0] == 200
        assert http("GET", f"{m.url}/stats")[1]["tokens_in_memory"] <= 400
    stats = http("GET", f"{m.url}/stats")[1]
    assert stats["evictions"] > 0 and stats["sessions_in_memory"] < 12
    _, tree = http("GET", f"{m.url}/trajectories/long")  # everything is still in the store
    assert tree["num_branches"] == 1 and tree["num_tokens"] > 200


def test_one_busy_session_is_held_within_its_budget_and_pushes_no_other_out(fake_manager, http, wait_for):
    """The audit's case: 32 fresh 4,000-token prompts at once in one session took the manager to 990 MB while
    /stats said 0 tokens, and in a mixed run pushed 10,000 other sessions out of memory. Prompts in flight now
    count, a session's requests in flight hold at most its budget (429 beyond), and a busy session's excess
    does not evict the others."""
    config = ManagerConfig(default_max_tokens=8, max_tokens_in_memory=30_000, max_session_tokens_in_memory=10_000)
    m, _ = fake_manager(config=config, reply_tokens=4)
    for i in range(20):
        assert http("POST", f"{m.base_url(f'small{i}')}/chat/completions", say(f"hello {i}"))[0] == 200
    m.call(m.manager.pause())  # the busy session's requests stay in flight
    prompt = " ".join(f"w{i}" for i in range(1500))  # about 6,400 tokens each, no two alike
    with ThreadPoolExecutor(32) as pool:
        calls = [pool.submit(http, "POST", f"{m.base_url('busy')}/chat/completions", say(f"{k} {prompt}"))
                 for k in range(32)]  # fmt: skip
        wait_for(lambda: sum(f.done() for f in calls) >= 28, what="the requests beyond the budget refused")
        stats = http("GET", f"{m.url}/stats")[1]
        busy = m.manager.sessions._live["busy"]
        assert 1 <= busy.in_flight <= 4 and busy.pending <= 10_000
        assert stats["tokens_in_memory"] >= busy.pending > 0  # what is in flight is counted
        assert stats["sessions_in_memory"] == 21  # nobody was pushed out
        m.call(m.manager.resume())
        results = [f.result(timeout=60) for f in calls]
    refused = [body for status, body in results if status == 429]
    assert len(refused) >= 28 and "per-session budget of 10,000" in refused[0]["error"]["message"]
    assert sum(status == 200 for status, _ in results) == 32 - len(refused)
    assert http("GET", f"{m.url}/stats")[1]["sessions_in_memory"] >= 20


# ---- access ----


def test_with_a_token_only_the_agents_calls_are_open(fake_manager, http):
    m, _ = fake_manager(config=ManagerConfig(admin_token="s3cret", default_max_tokens=8), reply_tokens=3)
    assert http("POST", f"{m.base_url('a')}/chat/completions", say("hi"))[0] == 200  # agents need no token
    assert http("GET", f"{m.base_url('a')}/models")[0] == 200
    assert http("GET", f"{m.url}/health")[0] == 200
    for method, path, body in [("GET", "/trajectories", None), ("GET", "/trajectories/a", None),
                               ("POST", "/trajectories/a", {"reward": 1.0}), ("GET", "/stats", None),
                               ("POST", "/admin/pause", {}), ("POST", "/admin/resume", {})]:  # fmt: skip
        status, err = http(method, f"{m.url}{path}", body)
        assert status == 401 and err["error"]["code"] == "unauthorized", (path, err)
    headers = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
    assert raw("GET", f"{m.url}/trajectories/a", headers=headers)[0] == 200
    bad = {"Authorization": "Bearer s3cr\xe9t"}  # latin-1 on the wire: not ASCII
    status, err, _ = raw("GET", f"{m.url}/stats", headers=bad)
    assert status == 401 and err["error"]["type"] == "authentication_error"


def test_annotations_keep_their_history(fake_manager, http):
    m, _ = fake_manager(reply_tokens=3)
    assert http("POST", f"{m.base_url('g')}/chat/completions", say("solve it"))[0] == 200
    assert http("POST", f"{m.url}/trajectories/g", {"reward": 0.0, "author": "grader-1"})[0] == 200
    assert http("POST", f"{m.url}/trajectories/g", {"reward": 1.0})[0] == 200  # someone raises the reward
    _, tree = http("GET", f"{m.url}/trajectories/g")
    assert tree["annotations"]["reward"] == 1.0
    history = tree["annotation_history"]
    assert [h["updates"] for h in history] == [{"reward": 0.0}, {"reward": 1.0}]
    assert history[0]["author"].startswith("grader-1 (127.0.0.1")
    assert history[1]["author"].startswith("127.0.0.1")


def test_an_author_that_is_not_valid_unicode_still_stores_the_reward(fake_manager, http):
    # A User-Agent of bytes that are not UTF-8, and a JSON author holding a lone surrogate: each is kept readable
    # (the bad characters replaced) in the annotation history, and the reward is stored.
    m, _ = fake_manager(reply_tokens=3)
    assert http("POST", f"{m.base_url('g')}/chat/completions", say("solve it"))[0] == 200
    url = f"{m.url}/trajectories/g"
    json_type = {"Content-Type": "application/json"}
    status, body, _ = raw("POST", url, b'{"reward": 0.5}', {**json_type, "User-Agent": "ok\xff\xfe"})
    assert status == 200, body
    status, body, _ = raw("POST", url, b'{"reward": 1.0, "author": "grader-\\ud800"}', json_type)
    assert status == 200, body
    _, tree = http("GET", url)
    assert tree["annotations"]["reward"] == 1.0
    first, second = (h["author"] for h in tree["annotation_history"])
    assert first.startswith("127.0.0.1 ok") and second.startswith("grader-")
    assert all(author.encode("utf-8") for author in (first, second))


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5"])
def test_serve_refuses_a_public_host_without_a_token(host, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    result = subprocess.run(
        [sys.executable, "-m", "reference", "serve", "--host", host, "--backend", "fake", "--store",
         str(tmp_path / "t.sqlite")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "non-loopback host" in result.stderr, result.stderr


# ---- bad input ----

NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (NESTED.encode(), "not valid JSON"),
        (
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": json.loads("[" * 80 + "]" * 80)}]}
            ).encode(),
            "deeper than 64",
        ),  # fmt: skip
        (b'{"model": "seamlessflow-tiny", "messages": [{"role": "user", "content": "a"}], "top_p": NaN}', "NaN"),
        (json.dumps(say("a", temperature=float("nan"))).encode(), "NaN"),
        (json.dumps(say("a", seed=2**64)).encode(), "'seed' must be in [0, 9223372036854775807]"),
        (json.dumps(say("a", max_tokens=10**5000 // 10**4700)).encode(), "'max_tokens' must be in"),
    ],
)
def test_bad_bodies_get_400s(fake_manager, body, needle):
    m, _ = fake_manager(reply_tokens=3)
    status, err, _ = raw("POST", f"{m.base_url('x')}/chat/completions", body, {"Content-Type": "application/json"})
    assert status == 400 and needle in err["error"]["message"], err
    assert raw("GET", f"{m.url}/health")[0] == 200


def test_nested_meta_and_long_urls_get_json_errors(fake_manager, http):
    m, _ = fake_manager(reply_tokens=3)
    assert http("POST", f"{m.base_url('n')}/chat/completions", say("hi"))[0] == 200
    meta = json.loads('{"a":' * 70 + "1" + "}" * 70)
    status, err = http("POST", f"{m.url}/trajectories/n", {"meta": meta})
    assert status == 400 and "deeper than 64" in err["error"]["message"]
    status, err = http("POST", f"{m.base_url('s' * 10_000)}/chat/completions", say("hi"))
    assert status == 400 and err["error"]["param"] == "session_id"
    status, err = http("GET", f"{m.url}/trajectories/{'s' * 100_000}")  # past the request-line limit
    assert 400 <= status < 500 and "error" in err


def test_seeds_near_the_limit_work_with_n_samples(fake_manager, http):
    m, _ = fake_manager(reply_tokens=3)
    status, body = http("POST", f"{m.base_url('seed')}/chat/completions", say("hi", seed=2**63 - 1, n=3))
    assert status == 200 and len(body["choices"]) == 3


# ---- overload ----


def test_requests_beyond_the_in_flight_cap_get_429(wait_for, fake_manager, http):
    m, engines = fake_manager(config=ManagerConfig(max_in_flight_requests=2, default_max_tokens=8), reply_tokens=8)
    m.call(m.manager.pause())  # hold the first two requests in flight
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(http, "POST", f"{m.base_url(f'h{i}')}/chat/completions", say("wait")) for i in range(2)]
        wait_for(lambda: m.manager.in_flight == 2, what="two requests in flight")
        status, err, headers = raw("POST", f"{m.base_url('third')}/chat/completions", json.dumps(say("hi")).encode(),
                                   {"Content-Type": "application/json"})  # fmt: skip
        m.call(m.manager.resume())
        assert [f.result(timeout=60)[0] for f in held] == [200, 200]
    assert status == 429 and err["error"]["code"] == "overloaded" and headers["Retry-After"] == "1"
    assert http("POST", f"{m.base_url('third')}/chat/completions", say("hi"))[0] == 200


def _slow_bodies(url: str, n: int, announced: int) -> list:
    """`n` connections that send a chat request's headers announcing `announced` body bytes, and never the body."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    out = []
    for i in range(n):
        sock = socket.create_connection((where.hostname, where.port), timeout=30)
        sock.sendall(f"POST /s/slow{i}/v1/chat/completions HTTP/1.1\r\nHost: {where.netloc}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {announced}\r\n\r\n".encode())  # fmt: skip
        out.append(sock)
    return out


def test_connections_that_never_send_their_body_do_not_lock_agents_out(wait_for, fake_manager, http):
    """Slowloris: clients that send headers and then nothing held an in-flight slot each, so a few of them (4,200 at
    the default cap) left every agent with 429. A body now holds no slot until it has arrived, and must arrive
    within body_timeout_s."""
    config = ManagerConfig(default_max_tokens=8, max_in_flight_requests=4, max_loop_lag_s=0, body_timeout_s=3.0)
    m, _ = fake_manager(config=config, reply_tokens=4)
    slow = _slow_bodies(m.url, 20, 1000)
    try:
        wait_for(lambda: m.manager.body_bytes == 20_000, what="20 bodies being read")
        status, body = http("POST", f"{m.base_url('agent')}/chat/completions", say("hi"))
        assert status == 200, body
        answer = slow[0].recv(4096)  # the server gives up on a body that does not come
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 3 s" in answer, answer[:300]
        wait_for(lambda: m.manager.body_bytes == 0, what="every slow body given up")
    finally:
        for sock in slow:
            sock.close()
    assert http("GET", f"{m.url}/health")[0] == 200


def test_request_bodies_in_flight_are_capped_before_they_are_read(wait_for, fake_manager, http):
    config = ManagerConfig(default_max_tokens=8, max_body_bytes_in_flight=10_000, body_timeout_s=30)
    m, _ = fake_manager(config=config, reply_tokens=4)
    slow = _slow_bodies(m.url, 1, 8_000)
    try:
        wait_for(lambda: m.manager.body_bytes == 8_000, what="a body being read")
        big = json.dumps(say("x" * 3000)).encode()
        status, err, headers = raw("POST", f"{m.base_url('big')}/chat/completions", big,
                                   {"Content-Type": "application/json"})  # fmt: skip
        assert status == 429 and headers["Retry-After"] == "1", err
        assert "would pass the limit of 10,000" in err["error"]["message"]
        assert http("POST", f"{m.base_url('small')}/chat/completions", say("hi"))[0] == 200  # room for a small one
    finally:
        slow[0].close()
    wait_for(lambda: m.manager.body_bytes == 0, what="the slow body dropped with its connection")
    assert http("POST", f"{m.base_url('big')}/chat/completions", say("x" * 3000))[0] == 200


def test_a_pause_that_is_never_resumed_ends(fake_manager, http):
    m, _ = fake_manager(config=ManagerConfig(max_pause_s=0.5, default_max_tokens=8), reply_tokens=4)
    m.call(m.manager.pause())
    status, body = http("POST", f"{m.base_url('w')}/chat/completions", say("still there?"))  # waits out the pause
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
    assert http("GET", f"{m.url}/stats")[1]["watchdog_resumes"] == 1


def test_many_threads_of_bad_and_good_requests(fake_manager, http):
    """Bad requests mixed into good ones: every good one is answered and stored, the server stays up."""
    m, _ = fake_manager(reply_tokens=3)
    bad = [b"{", b"[]", json.dumps(say("a", top_p=0)).encode(), NESTED.encode()[:20000]]

    def client(i: int) -> int:
        if i % 3 == 0:
            return raw("POST", f"{m.base_url(f'c{i}')}/chat/completions", bad[i % len(bad)],
                       {"Content-Type": "application/json"})[0]  # fmt: skip
        return http("POST", f"{m.base_url(f'c{i}')}/chat/completions", say(f"n{i}"))[0]

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(client, range(60)))
    assert all(s == 400 for s in statuses[::3]) and all(s == 200 for i, s in enumerate(statuses) if i % 3)
    assert len(http("GET", f"{m.url}/trajectories")[1]["sessions"]) == 40


def test_a_lagging_event_loop_lowers_the_in_flight_limit(wait_for, fake_manager, http):
    m, _ = fake_manager(config=ManagerConfig(max_loop_lag_s=0.1, default_max_tokens=8), reply_tokens=3)
    m.call(m.manager.loop_lag.close())  # the test drives the limit itself
    admission = m.manager.admission
    assert admission.limit == 4096
    m.call(m.manager.pause())  # keep requests in flight
    with ThreadPoolExecutor(20) as pool:
        held = [pool.submit(http, "POST", f"{m.base_url(f'h{i}')}/chat/completions", say("wait")) for i in range(20)]
        wait_for(lambda: m.manager.in_flight == 20, what="20 requests in flight")
        admission.update(lag_s=0.3, in_flight=m.manager.in_flight)  # the loop lags: the limit drops below 20
        assert admission.limit == 16
        status, err = http("POST", f"{m.base_url('new')}/chat/completions", say("hi"))
        m.call(m.manager.resume())
        assert [f.result(timeout=60)[0] for f in held] == [200] * 20
    assert status == 429 and "limit of 16 requests in flight" in err["error"]["message"], err
    for _ in range(100):  # the loop keeps up while the limit is used: it grows back to the cap
        admission.update(lag_s=0.0, in_flight=admission.limit)
    assert admission.limit == 4096
    assert http("POST", f"{m.base_url('new')}/chat/completions", say("hi"))[0] == 200


def test_the_in_flight_limit_is_cut_once_per_slow_stretch_and_a_lull_does_not_drop_it_to_the_floor():
    limit = AdaptiveLimit(cap=4096, target_lag_s=0.1, hold=4)
    limit.update(lag_s=0.3, in_flight=1000)  # the loop lags with 1,000 in flight
    assert limit.limit == 700
    for _ in range(4):  # the same slow stretch (the lag is smoothed): held while the refused requests drain
        limit.update(lag_s=0.3, in_flight=700)
    assert limit.limit == 700
    limit.update(lag_s=0.3, in_flight=700)  # still lagging after the hold: cut again
    assert limit.limit == int(700 * 0.7)
    steady = AdaptiveLimit(cap=4096, target_lag_s=0.1)
    for _ in range(10):
        steady.update(lag_s=0.05, in_flight=200)
    steady.update(lag_s=0.2, in_flight=0)  # sampled just after a batch finished: 70% of the smoothed count
    assert steady.limit == int(0.7 * steady.in_flight) and steady.limit > 60, steady.limit


def test_loop_lag_is_measured():
    import asyncio

    from reference.manager.load import LoopLag

    async def main() -> tuple[float, float]:
        lag = LoopLag(interval_s=0.02)
        lag.start()
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # the loop is blocked: the lag timer fires late
        await asyncio.sleep(0.05)
        blocked = lag.max_lag_s
        await asyncio.sleep(0.5)  # a free loop again: the smoothed lag decays
        await lag.close()
        return blocked, lag.lag_s

    blocked, after = asyncio.run(main())
    assert blocked >= 0.25
    assert after < 0.05


def test_tune_gc_collects_young_garbage_less_often_and_still_frees_cycles():
    import gc
    import weakref

    from reference.manager.load import tune_gc

    class Node:
        pass

    old = gc.get_threshold()
    try:
        assert tune_gc(12_345) == old
        assert gc.get_threshold() == (12_345, 20, 10)
        assert gc.get_freeze_count() > 0  # what existed before is never scanned again
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after: still garbage that a collection frees
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
        tune_gc(0)  # 0 leaves the thresholds as they are
        assert gc.get_threshold() == (12_345, 20, 10)
        with pytest.raises(ValueError, match="got -1"):
            tune_gc(-1)
    finally:
        gc.unfreeze()
        gc.set_threshold(*old)


def test_serve_refuses_a_negative_gc_threshold(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "reference", "serve", "--gc-young", "-1", "--backend", "fake", "--store",
         str(tmp_path / "t.sqlite")],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "."},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--gc-young must be >= 0" in result.stderr, result.stderr


@pytest.mark.parametrize("where", ["loop", "thread"])
def test_the_store_writer_survives_an_unexpected_error(fake_manager, http, monkeypatch, where):
    """A write that fails unexpectedly, on the event loop (the journal) or in the writer thread (here: the
    journal declines every record), fails its request alone."""
    m, _ = fake_manager(reply_tokens=3)
    name = "journal" if where == "loop" else "append_many"
    real = getattr(m.store, name)
    calls = []

    def broken_once(turns):
        calls.append(len(turns))
        if len(calls) == 1:
            raise TypeError("something nobody expected")
        return real(turns)

    if where == "thread":
        monkeypatch.setattr(m.store, "journal", lambda turns: None)
    monkeypatch.setattr(m.store, name, broken_once)
    status, err = http("POST", f"{m.base_url('w')}/chat/completions", say("one"))
    assert status == 503 and "something nobody expected" in err["error"]["message"], err
    assert http("POST", f"{m.base_url('w')}/chat/completions", say("two"))[0] == 200
    _, tree = http("GET", f"{m.url}/trajectories/w")
    assert tree["num_branches"] == 1 and len(tree["branches"][0]["request_ids"]) == 1


def test_small_records_are_journaled_and_large_ones_stored_by_the_writer_thread(fake_manager, http, monkeypatch):
    from reference.manager import recorder

    m, _ = fake_manager(reply_tokens=3)
    rec = m.manager.recorder
    assert http("POST", f"{m.base_url('small')}/chat/completions", say("one"))[0] == 200
    assert (rec.committed, rec.journaled) == (1, 1)
    monkeypatch.setattr(recorder, "INLINE_MAX_TOKENS", 1)  # every record is now too large for the loop
    assert http("POST", f"{m.base_url('large')}/chat/completions", say("two"))[0] == 200
    assert (rec.committed, rec.journaled) == (2, 1)
    _, tree = http("GET", f"{m.url}/trajectories/large")
    assert tree["num_branches"] == 1


def test_a_stalled_disk_stalls_neither_health_nor_the_server_and_an_answer_waits_at_most_its_bound(
    fake_manager, http, monkeypatch, wait_for
):
    """The audit's frozen file system: the journal's write ran on the event loop, so a 20 s freeze froze /health
    and every session. Writes now run in a thread; /health says the store is stalled, a request waits at most
    durable_within_s for its record (then 503), and the record is kept when the disk thaws."""
    import threading

    m, _ = fake_manager(config=ManagerConfig(default_max_tokens=8, durable_within_s=1.0), reply_tokens=3)
    real, thaw = m.store.journal, threading.Event()

    def frozen(turns):
        thaw.wait(60)  # a frozen file system: the write returns at the thaw
        return real(turns)

    monkeypatch.setattr(m.store, "journal", frozen)
    try:
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(http, "POST", f"{m.base_url('frozen')}/chat/completions", say("one"))
            report = wait_for(lambda: (r := http("GET", f"{m.url}/health", timeout_s=5)[1])["status"] == "unhealthy"
                              and r, what="/health to say the store is stalled")  # fmt: skip
            assert any("journal write has been under way" in reason for reason in report["reasons"]), report
            assert http("GET", f"{m.url}/v1/models", timeout_s=5)[0] == 200  # the loop serves
            status, err = stuck.result(timeout=30)
        assert status == 503 and "durable within 1 s" in err["error"]["message"], err
    finally:
        thaw.set()
    wait_for(lambda: http("GET", f"{m.url}/trajectories/frozen")[0] == 200, what="the record to land after the thaw")
    assert m.manager.recorder.timed_out == 1
    assert http("POST", f"{m.base_url('after')}/chat/completions", say("two"))[0] == 200
    assert http("GET", f"{m.url}/health")[0] == 200


def test_the_writer_thread_folds_the_journal_soon_after_and_when_a_segment_fills(
    fake_manager, http, monkeypatch, wait_for, tmp_path
):
    from reference.manager import journal, recorder

    monkeypatch.setattr(recorder, "FOLD_AFTER_S", 3600.0)  # only a full segment triggers a fold
    monkeypatch.setattr(journal, "FOLD_RECORDS", 3)
    path = tmp_path / "t.sqlite"
    m, _ = fake_manager(store=path, reply_tokens=3)

    def folded() -> int:
        outside = sqlite3.connect(path)  # what another process reading the file sees
        try:
            return outside.execute("SELECT COUNT(*) FROM turns").fetchone()[0]
        finally:
            outside.close()

    for i in range(3):
        assert folded() == 0
        assert http("POST", f"{m.base_url(f'c{i}')}/chat/completions", say("hi"))[0] == 200
    wait_for(lambda: folded() == 3, what="the full segment to be folded")
    monkeypatch.setattr(recorder, "FOLD_AFTER_S", 0.05)
    monkeypatch.setattr(journal, "FOLD_RECORDS", 100)
    for i in range(3, 5):
        assert http("POST", f"{m.base_url(f'c{i}')}/chat/completions", say("hi"))[0] == 200
    wait_for(lambda: folded() == 5, what="the rest to be folded FOLD_AFTER_S after the first of them")
    _, stats = http("GET", f"{m.url}/stats")
    assert (stats["recorded"], stats["records_journaled"], stats["records_unfolded"]) == (5, 5, 0)


def test_the_admin_token_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from reference.cli import admin_token, parser

    monkeypatch.delenv("SEAMLESSFLOW_ADMIN_TOKEN", raising=False)
    assert admin_token(parser().parse_args(["serve"])) is None
    monkeypatch.setenv("SEAMLESSFLOW_ADMIN_TOKEN", "from-env")
    assert admin_token(parser().parse_args(["serve", "--host", "0.0.0.0"])) == "from-env"
    secret = tmp_path / "token"
    secret.write_text("from-file\n")
    assert admin_token(parser().parse_args(["serve", "--admin-token-file", str(secret)])) == "from-file"
    secret.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        admin_token(parser().parse_args(["serve", "--admin-token-file", str(secret)]))
    with pytest.raises(ValueError, match="--admin-token is not accepted") as refused:  # argv is visible to all
        admin_token(parser().parse_args(["serve", "--admin-token", "s3cret"]))
    assert "s3cret" not in str(refused.value)


def test_reading_a_huge_trajectory_does_not_stall_other_clients(fake_manager, http, tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    generated = list(range(4, 4004)) * 10  # 40k tokens a turn
    for turn in range(10):  # one session of 10 turns, each a new branch off the first prompt: ~2.2 M listed tokens
        prompt = [1, 2, 3, turn + 5]
        store.append("big", f"r{turn}", None, 0, prompt, generated, [-0.5] * len(generated), [turn] * len(generated),
                      "length", "")  # fmt: skip
    m, _ = fake_manager(store=store, reply_tokens=3)
    health_s = []
    with ThreadPoolExecutor(1) as pool:
        start = time.perf_counter()
        # the body is parsed after the loop: one json.loads holds this process's GIL (the manager's too)
        big = pool.submit(lambda: urllib.request.urlopen(f"{m.url}/trajectories/big", timeout=120).read())
        while not big.done():  # other clients keep being answered while the tree is built and serialised
            t = time.perf_counter()
            assert http("GET", f"{m.url}/health")[0] == 200
            health_s.append(time.perf_counter() - t)
        total_s = time.perf_counter() - start
        tree = json.loads(big.result(timeout=120))
    assert tree["num_branches"] == 10 and len(tree["branches"][0]["token_ids"]) == 40004
    assert len(health_s) >= 3 and max(health_s) < total_s / 2, (health_s, total_s)


@pytest.mark.parametrize(
    "obj",
    [
        {"a": list(range(10_000)), "b": [{"x": [0.5] * 5000, "y": None}, {}], "c": 'é"\n', "d": []},
        list(range(4097)),
        [[1, 2], [3]] * 3000,
        {"nested": {"deep": [True, False, None, -1.25e-7]}},
        "plain",
    ],
)
def test_trees_are_serialised_in_slices_exactly_as_json_dumps_would(obj):
    compact = json.dumps(obj, separators=(",", ":")).encode()
    assert dumps_in_slices(obj) == compact and dumps_in_slices(obj, slice_len=7) == compact
