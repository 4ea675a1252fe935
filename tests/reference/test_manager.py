"""The trajectory manager through the official OpenAI client, over deterministic fake engines.

The fake engine's tokens are a pure function of (context, version), so every recorded token can
be checked against what the engine must have produced.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from reference.engine.base import Finished, TokenBatch, TokenEvent
from reference.engine.fake import FakeEngine, ScriptedEngine
from reference.manager.embedded import ManagerThread
from reference.manager.manager import ManagerConfig

MODEL = "seamlessflow-tiny"


def expected_tokens(engine: FakeEngine, prompt, versions) -> list[int]:
    """What the fake engine samples after `prompt`, one token per entry of `versions`."""
    context, out = list(prompt), []
    for v in versions:
        t = FakeEngine.next_token(context, v, engine.vocab_size)
        context.append(t)
        out.append(t)
    return out


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def test_multi_turn_session_is_one_branch_with_exact_tokens(fake_manager, openai_client, http, tok):
    m, (engine,) = fake_manager(reply_tokens=10)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi ✓ ünïcode"}]
    prompts, outputs = [], []
    with openai_client(m.base_url("ep-1")) as client:
        for turn in range(3):
            r = chat(client, messages)
            traj = r.model_extra["trajectory"]
            prompts.append(engine.consumed[f"{traj['request_id']}.0"])
            outputs.append(traj["token_ids"])
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"tool output {turn}\n  indented"}]  # fmt: skip
            assert r.usage.completion_tokens == len(traj["token_ids"]) > 0
    # Each turn's prompt extends the previous turn's prompt + completion, token for token ...
    for k in (1, 2):
        assert prompts[k][: len(prompts[k - 1]) + len(outputs[k - 1])] == (*prompts[k - 1], *outputs[k - 1])
    # ... so the session is one branch equal to the last prompt + completion.
    status, tree = http("GET", f"{m.url}/trajectories/ep-1")
    assert status == 200 and tree["num_branches"] == 1
    (branch,) = tree["branches"]
    assert branch["token_ids"] == [*prompts[2], *outputs[2]]
    generated = [i for i, g in enumerate(branch["generated_mask"]) if g]
    expected_positions = []
    for k in range(3):
        start = len(prompts[k])
        expected_positions += range(start, start + len(outputs[k]))
    assert generated == expected_positions
    # Every generated token is exactly what the engine produced (the fake forces its last token to a
    # stop token), with its logprob and version 0.
    for k in range(3):
        start, n = len(prompts[k]), len(outputs[k])
        assert branch["token_ids"][start : start + n - 1] == expected_tokens(engine, prompts[k], [0] * (n - 1))
        assert branch["token_ids"][start + n - 1] in (tok.eos_token_id, tok.im_end_id)
    assert all(branch["versions"][i] == 0 for i in generated)
    assert all(branch["logprobs"][i] == FakeEngine.logprob(branch["token_ids"][i]) for i in generated)
    assert all(branch["logprobs"][i] is None for i in range(len(branch["token_ids"])) if i not in generated)


def test_assistant_turns_are_spliced_not_retokenised(fake_manager, openai_client, tok):
    """The fake samples arbitrary ids, whose text re-tokenises differently; the manager must reuse
    the sampled ids, not the re-tokenised text."""
    m, (engine,) = fake_manager(reply_tokens=24)
    messages = [{"role": "user", "content": "go"}]
    with openai_client(m.base_url("splice")) as client:
        r1 = chat(client, messages)
        ids1 = r1.model_extra["trajectory"]["token_ids"]
        text = r1.choices[0].message.content
        assert tok.encode(text) != ids1[:-1]  # re-tokenising the text would not give the sampled ids
        r2 = chat(client, [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}])
    p1 = engine.consumed[f"{r1.model_extra['trajectory']['request_id']}.0"]
    p2 = engine.consumed[f"{r2.model_extra['trajectory']['request_id']}.0"]
    assert p2[: len(p1) + len(ids1)] == (*p1, *ids1)
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(p1) + len(ids1)


def test_rewritten_history_becomes_a_branch(fake_manager, openai_client, http):
    m, _ = fake_manager(reply_tokens=6)
    with openai_client(m.base_url("fork")) as client:
        r1 = chat(client, [{"role": "user", "content": "task A"}])
        a = r1.choices[0].message.content
        chat(client, [{"role": "user", "content": "task A"}, {"role": "assistant", "content": a},
                      {"role": "user", "content": "continue"}])  # fmt: skip
        chat(client, [{"role": "user", "content": "task A, rephrased"}])
    _, tree = http("GET", f"{m.url}/trajectories/fork")
    assert tree["num_branches"] == 2
    lengths = sorted(len(b["request_ids"]) for b in tree["branches"])
    assert lengths == [1, 2]


def test_streaming_matches_non_streaming(fake_manager, openai_client, http):
    m, _ = fake_manager(reply_tokens=16)
    messages = [{"role": "user", "content": "stream please"}]
    with openai_client(m.base_url("s-a")) as client:
        whole = chat(client, messages, seed=3)
    with openai_client(m.base_url("s-b")) as client:
        pieces, finish = [], None
        for chunk in chat(client, messages, seed=3, stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason == "stop"
    assert usage.completion_tokens == whole.usage.completion_tokens
    _, a = http("GET", f"{m.url}/trajectories/s-a")
    _, b = http("GET", f"{m.url}/trajectories/s-b")
    assert a["branches"][0]["token_ids"] == b["branches"][0]["token_ids"]


def test_stop_strings_and_max_tokens(fake_manager, openai_client):
    m, _ = fake_manager(reply_tokens=1000)
    with openai_client(m.base_url("limits")) as client:
        r = chat(client, [{"role": "user", "content": "x"}], max_tokens=7)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
        text = r.choices[0].message.content
        stop = text[2:4] if len(text) >= 4 else None
        if stop:
            s = chat(client, [{"role": "user", "content": "x"}], max_tokens=7, stop=[stop])
            assert s.choices[0].finish_reason == "stop"
            assert stop not in s.choices[0].message.content and text.startswith(s.choices[0].message.content)


def test_completions_with_text_and_token_ids(fake_manager, openai_client, tok):
    m, (engine,) = fake_manager(reply_tokens=5)
    with openai_client(m.base_url("cmpl")) as client:
        r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5)
        ids = tok.encode("def f(x):")
        assert engine.consumed[f"{r.model_extra['trajectory']['request_id']}.0"] == tuple(ids)
        r2 = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3)
        assert engine.consumed[f"{r2.model_extra['trajectory']['request_id']}.0"] == (5, 6, 7)
        assert r2.usage.completion_tokens == 3
        assert client.models.list().data[0].id == MODEL


def test_ignore_eos_generates_exactly_max_tokens(fake_manager, http, tok):
    """The fake ends its reply with a stop token after 5 tokens; with `ignore_eos` the engine is sent no stop
    token, so every sample runs to max_tokens, token for token what the engine samples, its text all of them."""
    m, (engine,) = fake_manager(reply_tokens=5)
    url = f"{m.base_url('forced')}/completions"
    _, stopped = http("POST", url, {"model": MODEL, "prompt": "x", "max_tokens": 12})
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert len(stopped["choices"][0]["trajectory"]["token_ids"]) == 5
    status, forced = http("POST", url, {"model": MODEL, "prompt": "x", "max_tokens": 12, "n": 2, "ignore_eos": True})
    assert status == 200, forced
    assert forced["usage"]["completion_tokens"] == 24
    for choice in forced["choices"]:
        ids = choice["trajectory"]["token_ids"]
        assert choice["finish_reason"] == "length"
        assert ids == expected_tokens(engine, tok.encode("x"), [0] * 12)
        assert choice["text"] == tok.decode(ids)


def test_ignore_eos_keeps_sampled_stop_tokens_in_streams_too(fake_manager, http, tok):
    """Over a 3-token vocabulary the fake samples <|endoftext|> and <|im_end|> on its own: with `ignore_eos` they
    are ordinary tokens, counted and kept in the text, streamed or not."""
    m, _ = fake_manager(vocab_size=3)
    body = {"model": MODEL, "prompt": [1, 1], "max_tokens": 16, "ignore_eos": True, "seed": 1}
    _, whole = http("POST", f"{m.base_url('tiny')}/completions", body)
    ids = whole["choices"][0]["trajectory"]["token_ids"]
    assert len(ids) == 16
    assert {tok.eos_token_id, tok.im_end_id} <= set(ids)
    assert whole["choices"][0]["text"] == tok.decode(ids)
    streamed = _stream_text(f"{m.base_url('tiny-stream')}/completions", {**body, "stream": True})
    assert streamed == whole["choices"][0]["text"]


def _stream_text(url: str, body: dict) -> str:
    import json
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(request, timeout=30) as response:
        for line in response:
            data = line.decode().strip().removeprefix("data: ")
            if data and data != "[DONE]":
                pieces += [c["text"] for c in json.loads(data)["choices"]]
    return "".join(pieces)


def test_partial_rollout_across_a_weight_update(fake_manager, openai_client, http):
    """Pause mid-generation, update the version, resume: the request finishes normally and its
    tokens carry the version that produced them."""
    m, (engine,) = fake_manager(reply_tokens=80, token_delay_s=0.01)
    result = {}

    def agent():
        with openai_client(m.base_url("pr")) as client:
            result["r"] = chat(client, [{"role": "user", "content": "long answer"}], max_tokens=80)

    t = threading.Thread(target=agent)
    t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # wait for a few tokens under version 0
        running = engine.running_contexts()
        if any(len(ctx) >= len(engine.consumed.get(rid, ctx)) + 3 for rid, ctx in running.items()):
            break
        time.sleep(0.005)
    assert http("POST", f"{m.url}/admin/pause", {})[0] == 200
    assert http("POST", f"{m.url}/admin/update_weights", {"version": 1})[0] == 200
    assert http("POST", f"{m.url}/admin/resume", {})[0] == 200
    t.join(30)
    r = result["r"]
    assert r.choices[0].finish_reason == "stop"
    traj = r.model_extra["trajectory"]
    versions = traj["versions"]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    prompt = engine.consumed[f"{traj['request_id']}.0"]
    expected = expected_tokens(engine, prompt, versions)
    assert traj["token_ids"][:-1] == expected[:-1]  # the last token is the forced stop token
    assert engine.reprefills == 1
    _, tree = http("GET", f"{m.url}/trajectories/pr")
    gen = [v for v, g in zip(tree["branches"][0]["versions"], tree["branches"][0]["generated_mask"], strict=True) if g]
    assert gen == versions


def test_update_weights_needs_pause(fake_manager, http):
    m, _ = fake_manager()
    status, body = http("POST", f"{m.url}/admin/update_weights", {"version": 3})
    assert status == 409 and "pause" in body["error"]["message"]
    assert http("POST", f"{m.url}/admin/update_weights", {"version": "x"})[0] == 400


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": MODEL}, 400, "'messages'"),
        ({"model": MODEL, "messages": "hi"}, 400, "'messages'"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400, "content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True}, 400, "'n'"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 65}, 400, "'n' must be at most 64"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "ignore_eos": "yes"}, 400, "'ignore_eos'"),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-9"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "context"),
    ],
)
def test_bad_chat_requests_get_openai_errors(fake_manager, http, body, status, needle):
    m, _ = fake_manager()
    got, err = http("POST", f"{m.base_url('bad')}/chat/completions", body)
    assert got == status, err
    assert needle in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    ok, _ = http("POST", f"{m.base_url('bad')}/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": "still serving?"}]})  # fmt: skip
    assert ok == 200


def test_bad_completions_and_limits(fake_manager, http, tok):
    m, _ = fake_manager()
    url = f"{m.base_url('bad2')}/completions"
    status, err = http("POST", url, {"model": MODEL, "prompt": [1, -5, 2]})
    assert status == 400 and "-5" in err["error"]["message"]
    status, err = http("POST", url, {"model": MODEL, "prompt": [tok.vocab_size + 10]})
    assert status == 400 and "vocabulary" in err["error"]["message"]
    status, err = http("POST", url, {"model": MODEL, "prompt": [1] * 9000})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    status, err = http("POST", url, b'{"model": "x", "prompt": "' + b"a" * (9 << 20) + b'"}')
    assert status == 413 and err["error"]["type"] == "invalid_request_error"
    status, err = http("POST", f"{m.url}/s/bad%20session!/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 400 and "session id" in err["error"]["message"]
    assert http("GET", f"{m.url}/trajectories/never-seen")[0] == 404
    assert http("GET", f"{m.url}/no/such/route")[0] == 404
    assert http("POST", url, {"model": MODEL, "prompt": "fine", "max_tokens": 2})[0] == 200
    assert http("GET", f"{m.url}/trajectories")[1]["sessions"] == ["bad2"]


def test_disconnect_frees_slot_and_keeps_session(fake_manager, openai_client, http):
    import openai

    m, (engine,) = fake_manager(reply_tokens=500, token_delay_s=0.01)
    with openai_client(m.base_url("dc")) as client:
        chat(client, [{"role": "user", "content": "first"}], max_tokens=3)
    _, before = http("GET", f"{m.url}/trajectories/dc")
    client = openai.OpenAI(base_url=m.base_url("dc"), api_key="none", max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        chat(client, [{"role": "user", "content": "second"}], max_tokens=400)
    client.close()
    deadline = time.monotonic() + 10
    while (engine.running_contexts() or m.manager.router.slots[0].in_flight) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.running_contexts() and m.manager.router.slots[0].in_flight == 0
    _, after = http("GET", f"{m.url}/trajectories/dc")
    assert after == before


def test_restarted_manager_serves_finished_trajectories(fake_manager, openai_client, http, tmp_path):
    store = tmp_path / "restart.sqlite"
    m, _ = fake_manager(store=store, reply_tokens=8)
    messages = [{"role": "user", "content": "remember me"}]
    with openai_client(m.base_url("keep")) as client:
        r = chat(client, messages)
    _, before = http("GET", f"{m.url}/trajectories/keep")
    m.close()
    m2, _ = fake_manager(store=store, reply_tokens=8)
    _, after = http("GET", f"{m2.url}/trajectories/keep")
    assert after == before
    # The restarted manager still splices the session's earlier completion: one branch.
    with openai_client(m2.base_url("keep")) as client:
        chat(client, [*messages, {"role": "assistant", "content": r.choices[0].message.content},
                      {"role": "user", "content": "next"}])  # fmt: skip
    _, grown = http("GET", f"{m2.url}/trajectories/keep")
    assert grown["num_branches"] == 1 and len(grown["branches"][0]["request_ids"]) == 2


def test_streamed_completions_and_logprobs(fake_manager, openai_client, tok):
    m, (engine,) = fake_manager(reply_tokens=9)
    with openai_client(m.base_url("cs")) as client:
        whole = client.completions.create(model=MODEL, prompt="x = ", max_tokens=9, logprobs=1)
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(model=MODEL, prompt="x = ", max_tokens=9, stream=True)
        )
        lp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y"}], logprobs=True)
    assert streamed == whole.choices[0].text
    ids = whole.model_extra["trajectory"]["token_ids"]
    assert whole.choices[0].logprobs.token_logprobs == [FakeEngine.logprob(t) for t in ids]
    content = lp.choices[0].logprobs.content
    assert [c.logprob for c in content] == [FakeEngine.logprob(t) for t in lp.model_extra["trajectory"]["token_ids"]]


def test_streaming_client_that_disconnects_frees_its_slot(fake_manager, http):
    import json as _json
    from http.client import HTTPConnection

    m, (engine,) = fake_manager(reply_tokens=500, token_delay_s=0.01)
    conn = HTTPConnection("127.0.0.1", m.port, timeout=10)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 400, "stream": True}
    conn.request("POST", "/s/sdc/v1/chat/completions", _json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.close()  # walk away mid-stream
    deadline = time.monotonic() + 10
    while (engine.running_contexts() or m.manager.router.slots[0].in_flight) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.running_contexts() and m.manager.router.slots[0].in_flight == 0
    status, body = http("GET", f"{m.url}/trajectories/sdc")
    assert status == 404, body  # nothing recorded for an abandoned request: no session either


def test_idle_sessions_leave_memory_and_come_back_from_the_store(fake_manager, openai_client, http):
    from reference.manager.manager import ManagerConfig

    m, _ = fake_manager(config=ManagerConfig(default_max_tokens=16, max_sessions_in_memory=2), reply_tokens=6)
    replies = {}
    for name in ("a", "b", "c"):
        with openai_client(m.base_url(name)) as client:
            replies[name] = chat(client, [{"role": "user", "content": f"hi {name}"}])
    assert m.manager.sessions.ids() == ["b", "c"]  # "a" was the least recently used
    status, tree = http("GET", f"{m.url}/trajectories/a")  # reloaded from the store
    assert status == 200 and tree["num_branches"] == 1
    with openai_client(m.base_url("a")) as client:
        chat(client, [{"role": "user", "content": "hi a"},
                      {"role": "assistant", "content": replies["a"].choices[0].message.content},
                      {"role": "user", "content": "more"}])  # fmt: skip
    _, tree = http("GET", f"{m.url}/trajectories/a")
    assert tree["num_branches"] == 1 and len(tree["branches"][0]["request_ids"]) == 2
    assert http("GET", f"{m.url}/trajectories")[1]["sessions"] == ["a", "b", "c"]


def test_admin_token_guards_the_control_endpoints(fake_manager, http):
    import urllib.request

    from reference.manager.manager import ManagerConfig

    m, _ = fake_manager(config=ManagerConfig(admin_token="s3cret"))
    status, err = http("POST", f"{m.url}/admin/pause", {})
    assert status == 401 and err["error"]["type"] == "authentication_error"
    request = urllib.request.Request(f"{m.url}/admin/pause", data=b"{}", method="POST",
                                     headers={"Authorization": "Bearer s3cret"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    assert http("GET", f"{m.url}/health")[0] == 200  # only /admin/* is guarded


def test_concurrent_requests_in_one_session_replay_identically(fake_manager, openai_client, http, tmp_path):
    """Parallel turns of one session finish together and are group-committed; the store's replay must
    equal the live tree, anchors and all."""
    from concurrent.futures import ThreadPoolExecutor

    store = tmp_path / "parallel.sqlite"
    m, _ = fake_manager(store=store, reply_tokens=20, token_delay_s=0.001)
    system = {"role": "system", "content": "You are one of many parallel samples."}

    def ask(i: int):
        with openai_client(m.base_url("fanout")) as client:
            return chat(client, [system, {"role": "user", "content": f"variant {i % 4}"}], seed=i)

    with ThreadPoolExecutor(max_workers=12) as pool:
        replies = list(pool.map(ask, range(12)))
    _, live = http("GET", f"{m.url}/trajectories/fanout")
    assert sum(len(b["request_ids"]) for b in live["branches"]) == 12 == len(replies)
    m.close()
    m2, _ = fake_manager(store=store)
    _, replayed = http("GET", f"{m2.url}/trajectories/fanout")
    assert replayed == live


def test_rewards_and_task_ids_are_attached_and_survive_a_restart(fake_manager, openai_client, http, tmp_path):
    store = tmp_path / "rewards.sqlite"
    m, _ = fake_manager(store=store, reply_tokens=5)
    with openai_client(m.base_url("graded")) as client:
        chat(client, [{"role": "user", "content": "task one"}])
        chat(client, [{"role": "user", "content": "another attempt"}])  # a second branch
    url = f"{m.url}/trajectories/graded"
    status, body = http("POST", url, {"reward": 0.0, "task_id": "django__django-11099", "meta": {"grader": "v1"}})
    assert status == 200 and body["annotations"]["task_id"] == "django__django-11099"
    status, body = http("POST", url, {"branch_rewards": {"1": 1.0}, "meta": {"tests": 7}})
    assert body["annotations"]["meta"] == {"grader": "v1", "tests": 7}  # objects merge key by key
    _, tree = http("GET", url)
    assert [b["reward"] for b in tree["branches"]] == [0.0, 1.0]
    m.close()
    m2, _ = fake_manager(store=store)
    _, again = http("GET", f"{m2.url}/trajectories/graded")
    assert again["annotations"] == tree["annotations"] and [b["reward"] for b in again["branches"]] == [0.0, 1.0]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"reward": "high"}, "'reward' must be a finite number"),
        ({"reward": float("inf")}, "Infinity is not a JSON number"),  # the non-standard literal Infinity
        ({"branch_rewards": {"first": 1}}, "branch ids"),
        ({"score": 1}, "unknown annotation 'score'"),
        ({}, "non-empty object"),
        ({"task_id": 5}, "'task_id' must be a string"),
    ],
)
def test_bad_annotations_are_refused(fake_manager, openai_client, http, body, needle):
    m, _ = fake_manager(reply_tokens=3)
    with openai_client(m.base_url("a")) as client:
        chat(client, [{"role": "user", "content": "x"}])
    status, err = http("POST", f"{m.url}/trajectories/a", body)
    assert status == 400 and needle in err["error"]["message"]
    assert http("POST", f"{m.url}/trajectories/nobody", {"reward": 1})[0] == 404


def test_export_writes_every_branch_with_its_reward(fake_manager, openai_client, http, tmp_path):
    import json
    import subprocess
    import sys

    store = tmp_path / "export.sqlite"
    m, _ = fake_manager(store=store, reply_tokens=4)
    with openai_client(m.base_url("e1")) as client:
        chat(client, [{"role": "user", "content": "one"}])
        chat(client, [{"role": "user", "content": "two"}])
    with openai_client(m.base_url("e2")) as client:
        chat(client, [{"role": "user", "content": "three"}])
    http("POST", f"{m.url}/trajectories/e1", {"reward": 1.0, "task_id": "t-1"})
    trees = {sid: http("GET", f"{m.url}/trajectories/{sid}")[1] for sid in ("e1", "e2")}
    m.close()
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "reference", "export", "--store", str(store), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["session_id"], r["branch_id"]) for r in lines] == [("e1", 0), ("e1", 1), ("e2", 0)]
    for r in lines:
        branch = next(b for b in trees[r["session_id"]]["branches"] if b["branch_id"] == r["branch_id"])
        assert r["token_ids"] == branch["token_ids"] and r["logprobs"] == branch["logprobs"]
        assert r["reward"] == branch["reward"]
    assert lines[0]["task_id"] == "t-1" and lines[2]["reward"] is None
    subprocess.run([*cmd, "--rewarded-only"], check=True, capture_output=True)
    assert len(out.read_text().splitlines()) == 2
    bad = subprocess.run([*cmd[:-4], "--store", str(tmp_path / "missing.sqlite"), "--out", str(out)],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "no trajectory store" in bad.stderr


def test_n_samples_of_one_prompt_are_recorded_as_siblings(fake_manager, openai_client, http):
    m, (engine,) = fake_manager(reply_tokens=6)
    with openai_client(m.base_url("grpo")) as client:
        r = chat(client, [{"role": "user", "content": "2+2?"}], n=4, seed=10)
        c = client.completions.create(model=MODEL, prompt="x", n=3, max_tokens=4)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and len(c.choices) == 3
    ids = [ch.model_extra["trajectory"]["request_id"] for ch in r.choices]
    assert len(set(ids)) == 4
    assert r.usage.completion_tokens == sum(len(ch.model_extra["trajectory"]["token_ids"]) for ch in r.choices)
    assert r.usage.prompt_tokens == len(engine.consumed[f"{ids[0]}.0"])
    _, tree = http("GET", f"{m.url}/trajectories/grpo")
    assert sorted(rid for b in tree["branches"] for rid in b["request_ids"]) == sorted(
        [*ids, *(ch.model_extra["trajectory"]["request_id"] for ch in c.choices)]
    )


class _BatchedScript(ScriptedEngine):
    """A scripted engine that delivers its tokens in batches of `size`, as the HTTP client does (one batch a
    wire line): a stop string can then complete in the middle of a batch."""

    def __init__(self, script, size: int, **kw) -> None:
        super().__init__(script, **kw)
        self.size = size

    async def stream_batches(self, request):
        batch = TokenBatch([], [], [])
        async for event in self.stream(request):
            if isinstance(event, TokenEvent):
                batch.token_ids.append(event.token_id)
                batch.logprobs.append(event.logprob)
                batch.versions.append(event.version)
                if len(batch.token_ids) < self.size:
                    continue
            if batch.token_ids:
                yield batch
                batch = TokenBatch([], [], [])
            if isinstance(event, Finished):
                yield event


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_inside_a_batch_cuts_ids_logprobs_and_versions_together(tok, tmp_path, http, stream):
    """A stop string completed mid-batch: the answer ends before it, and the record keeps exactly the tokens up
    to it, each with its own log-prob and version (the store refused a record with more log-probs than ids)."""
    reply = tok.encode("alpha beta END gamma delta epsilon zeta eta theta")
    engine = _BatchedScript(lambda prompt: reply, size=len(reply), vocab_size=tok.vocab_size)
    with ManagerThread({"scripted": engine}, tok, tmp_path / "t.sqlite", ManagerConfig(default_max_tokens=64)) as m:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "stop": ["END"], "stream": stream}
        url = m.base_url("stop") + "/completions"
        if stream:
            assert _stream(url, body)[0] == 200
        else:
            status, answer = http("POST", url, body)
            assert status == 200
            assert answer["choices"][0]["text"] == "alpha beta "
            assert answer["choices"][0]["finish_reason"] == "stop"
        status, tree = http("GET", f"{m.url}/trajectories/stop")
    assert status == 200
    (branch,) = tree["branches"]
    generated = [i for i, g in enumerate(branch["generated_mask"]) if g]
    kept = [branch["token_ids"][i] for i in generated]
    assert tok.decode(kept).startswith("alpha beta END")
    assert len(kept) < len(reply)
    assert kept == reply[: len(kept)]
    assert [branch["logprobs"][i] for i in generated] == [FakeEngine.logprob(t) for t in kept]
    assert [branch["versions"][i] for i in generated] == [0] * len(kept)


def _stream(url: str, body: dict) -> tuple[int, str]:
    """(status, raw body) of a streamed completion."""
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.read().decode()
