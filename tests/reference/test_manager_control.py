"""Per-engine control for the tag scheduler: pause / update / resume subsets, preemption that moves a
request's tokens to another engine, and engines taken out of service while their resource trains.

Over deterministic fake engines whose tokens are a pure function of (context, version), so a request
that moved mid-generation can be checked token for token against what one engine would have produced.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from reference.engine.fake import FakeEngine
from reference.manager.manager import ManagerConfig

MODEL = "seamlessflow-tiny"


def say(text: str, max_tokens: int = 40) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


def engine_versions(http, m) -> dict[str, int]:
    return {e["name"]: e["version"] for e in http("GET", f"{m.url}/stats")[1]["engines"]}


def test_pause_update_and_resume_act_on_the_engines_named(fake_manager, http):
    m, (e0, e1) = fake_manager(n_engines=2, reply_tokens=4)
    assert http("POST", f"{m.url}/admin/pause", {"engines": ["fake-0"]})[0] == 200
    status, body = http("POST", f"{m.url}/admin/update_weights", {"version": 1})
    assert status == 409
    assert "fake-1 not paused" in body["error"]["message"]
    assert http("POST", f"{m.url}/admin/update_weights", {"version": 1, "engines": ["fake-0"]})[0] == 200
    assert engine_versions(http, m) == {"fake-0": 1, "fake-1": 0}
    assert (e0.version, e1.version) == (1, 0)
    stats = http("GET", f"{m.url}/stats")[1]
    assert stats["version"] == 1
    assert [e["paused"] for e in stats["engines"]] == [True, False]
    assert http("POST", f"{m.url}/admin/resume", {"engines": ["fake-0"]})[0] == 200
    assert not any(e["paused"] for e in http("GET", f"{m.url}/stats")[1]["engines"])


def test_control_calls_name_a_bad_engine_and_the_choices(fake_manager, http):
    m, _ = fake_manager(n_engines=2)
    status, body = http("POST", f"{m.url}/admin/pause", {"engines": ["nope"]})
    assert status == 400
    assert "'nope'" in body["error"]["message"] and "fake-0, fake-1" in body["error"]["message"]
    assert http("POST", f"{m.url}/admin/pause", {"engines": "fake-0"})[0] == 400
    assert http("POST", f"{m.url}/admin/pause", {"engines": []})[0] == 400
    assert http("POST", f"{m.url}/admin/preempt", {"engine": 3})[0] == 400
    assert http("POST", f"{m.url}/admin/preempt", {"engine": "nope"})[0] == 400
    assert http("POST", f"{m.url}/admin/serve", {"engine": "fake-0", "serving": "yes"})[0] == 400
    assert http("POST", f"{m.url}/admin/update_weights", {"version": -1})[0] == 400
    assert http("GET", f"{m.url}/stats")[1]["engines"][0]["paused"] is False  # nothing was applied


def test_preempted_requests_continue_on_another_engine_with_their_tokens(fake_manager, http, wait_for):
    """Preempting an engine mid-generation moves each of its requests, with the tokens it has, to the other
    engine; the agents get whole answers, and every recorded token is what the fake must have produced."""
    m, (e0, e1) = fake_manager(n_engines=2, reply_tokens=30, token_delay_s=0.01)
    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(http, "POST", f"{m.base_url(f'p{i}')}/chat/completions", say("go")) for i in range(4)]
        wait_for(lambda: sum(len(c) for c in e0._running.values()) >= 3 * len(e0.consumed), what="tokens on fake-0")
        status, body = http("POST", f"{m.url}/admin/preempt", {"engine": "fake-0"})
        results = [a.result(timeout=60) for a in answers]
    assert status == 200
    assert body["moved"] >= 1
    assert all(s == 200 for s, _ in results)
    moved = [r for _, r in results if f"{r['trajectory']['request_id']}.1" in e1.consumed]
    assert len(moved) == body["moved"]
    for r in moved:
        rid = r["trajectory"]["request_id"]
        first, second = e0.consumed[f"{rid}.0"], e1.consumed[f"{rid}.1"]
        tokens = r["trajectory"]["token_ids"]
        assert second == (*first, *tokens[: len(second) - len(first)])  # the tokens so far went along
        expected, context = [], list(first)
        for t in tokens[:-1]:  # the last is the forced stop token
            expected.append(FakeEngine.next_token(context, 0, e0.vocab_size))
            context.append(t)
        assert tokens[:-1] == expected
        assert r["choices"][0]["finish_reason"] == "stop"
    # fake-0 is out of service: new requests go to fake-1 until it serves again.
    before = len(e0.consumed)
    assert http("POST", f"{m.base_url('after')}/chat/completions", say("more", 4))[0] == 200
    assert len(e0.consumed) == before
    assert http("POST", f"{m.url}/admin/serve", {"engine": "fake-0", "serving": True})[0] == 200
    stats = http("GET", f"{m.url}/stats")[1]["engines"]
    assert [e["serving"] for e in stats] == [True, True]


def test_a_paused_engine_can_be_preempted(fake_manager, http, wait_for):
    """Preempting a paused engine moves its held requests to a running one (the fake ends a paused stream
    on abort, as the built-in engine does)."""
    m, (e0, _) = fake_manager(n_engines=2, reply_tokens=20, token_delay_s=0.01)
    assert http("POST", f"{m.url}/admin/serve", {"engine": "fake-1", "serving": False})[0] == 200
    result = {}
    t = threading.Thread(target=lambda: result.update(r=http("POST", f"{m.base_url('held')}/chat/completions",
                                                               say("wait"))))  # fmt: skip
    t.start()
    wait_for(lambda: any(len(c) > 3 for c in e0._running.values()), what="tokens on fake-0")
    assert http("POST", f"{m.url}/admin/pause", {"engines": ["fake-0"]})[0] == 200
    assert http("POST", f"{m.url}/admin/serve", {"engine": "fake-1", "serving": True})[0] == 200
    assert http("POST", f"{m.url}/admin/preempt", {"engine": "fake-0"})[1]["moved"] == 1
    t.join(60)
    status, body = result["r"]
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop"


def test_requests_wait_while_every_engine_is_out_of_service(fake_manager, http, wait_for):
    """With every engine training (none serving), a request waits for one to serve again instead of failing."""
    m, (e0,) = fake_manager(reply_tokens=3)
    assert http("POST", f"{m.url}/admin/serve", {"engine": "fake-0", "serving": False})[0] == 200
    result = {}
    t = threading.Thread(target=lambda: result.update(r=http("POST", f"{m.base_url('w')}/chat/completions",
                                                               say("hello?"))))  # fmt: skip
    t.start()
    wait_for(lambda: http("GET", f"{m.url}/stats")[1]["in_flight"] == 1, what="the request to arrive")
    assert not e0.consumed  # it waits in the manager, not on the engine
    assert http("POST", f"{m.url}/admin/serve", {"engine": "fake-0", "serving": True})[0] == 200
    t.join(30)
    assert result["r"][0] == 200


def test_a_request_fails_after_engine_wait_s_without_a_serving_engine(fake_manager, http):
    m, _ = fake_manager(config=ManagerConfig(engine_wait_s=0.3, default_max_tokens=4))
    http("POST", f"{m.url}/admin/serve", {"engine": "fake-0", "serving": False})
    status, body = http("POST", f"{m.base_url('late')}/chat/completions", say("anyone?"))
    assert status == 503
    assert "serving" in body["error"]["message"]


def test_the_watchdog_resumes_only_what_it_paused(fake_manager, http, wait_for):
    m, _ = fake_manager(n_engines=2, config=ManagerConfig(max_pause_s=0.3, default_max_tokens=4))
    m.call(m.manager.pause(["fake-0"]))
    wait_for(lambda: http("GET", f"{m.url}/stats")[1]["watchdog_resumes"] == 1, what="the watchdog")
    stats = http("GET", f"{m.url}/stats")[1]
    assert [e["paused"] for e in stats["engines"]] == [False, False]


def test_text_outside_the_tokenizer_is_a_400_not_a_500(tmp_path, http):
    """A task's small character vocabulary cannot encode every text: the agent gets a clear 400."""
    from reference.manager.embedded import ManagerThread
    from reference.tasks.tokenizer import task_tokenizer

    tok = task_tokenizer()
    with ManagerThread({"fake-0": FakeEngine(vocab_size=tok.vocab_size, reply_tokens=3)}, tok,
                       tmp_path / "t.sqlite") as m:  # fmt: skip
        body = {"model": MODEL, "prompt": "12+3=", "max_tokens": 3}
        assert http("POST", f"{m.base_url('ok')}/completions", body)[0] == 200
        status, err = http("POST", f"{m.base_url('bad')}/completions", {**body, "prompt": "hello"})
        assert status == 400
        assert err["error"]["code"] == "unencodable_text"
        status, err = http("POST", f"{m.base_url('chat')}/chat/completions", say("12"))
        assert status == 400  # the chat template's role names are letters
