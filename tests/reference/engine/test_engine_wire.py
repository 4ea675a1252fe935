"""The engine wire protocol in one process: token batches, heartbeats, in-band errors."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from reference.engine.base import EngineError, Finished, FinishReason, GenerateRequest, SamplingParams, TokenEvent
from reference.engine.client import HTTPEngine
from reference.engine.server import start_engine_server
from reference.engine.sockets import bound_port


class BurstyEngine:
    """Yields `n` tokens at once (no await between them), then fails if `fail`, else finishes; or first
    waits `quiet_s` without sending anything."""

    def __init__(self, n: int, fail: bool = False, quiet_s: float = 0.0) -> None:
        self.n, self.fail, self.quiet_s = n, fail, quiet_s

    async def stream(self, request):
        if self.quiet_s:
            await asyncio.sleep(self.quiet_s)
        for i in range(self.n):
            yield TokenEvent(i, -0.5 * i, 3)
        if self.fail:
            raise RuntimeError("GPU fell off the bus")
        yield Finished(FinishReason.LENGTH)


async def _collect(engine, heartbeat_s: float = 5.0, stall_s: float = 60.0, batched: bool = True) -> list:
    runner = await start_engine_server(engine, heartbeat_s=heartbeat_s)
    client = HTTPEngine(f"http://127.0.0.1:{bound_port(runner)}", stall_timeout_s=stall_s, batch_requests=batched)
    events = []
    try:
        async for event in client.stream(GenerateRequest("r", (1, 2), SamplingParams(max_tokens=99))):
            events.append(event)
    except EngineError as e:
        events.append(e)
    finally:
        await client.close()
        await runner.cleanup()
    return events


BATCHED = pytest.mark.parametrize("batched", [True, False], ids=["generate_many", "generate"])


@BATCHED
def test_a_burst_of_tokens_arrives_intact_and_in_order(batched):
    events = asyncio.run(_collect(BurstyEngine(300), batched=batched))
    assert events[:-1] == [TokenEvent(i, -0.5 * i, 3) for i in range(300)]
    assert events[-1] == Finished(FinishReason.LENGTH)


@BATCHED
def test_tokens_before_a_failure_are_delivered_then_the_error(batched):
    events = asyncio.run(_collect(BurstyEngine(5, fail=True), batched=batched))
    assert events[:5] == [TokenEvent(i, -0.5 * i, 3) for i in range(5)]
    assert isinstance(events[5], EngineError) and "GPU fell off the bus" in str(events[5])


@BATCHED
def test_heartbeats_keep_a_quiet_stream_alive(batched):
    events = asyncio.run(_collect(BurstyEngine(2, quiet_s=2.0), heartbeat_s=0.1, stall_s=1.0, batched=batched))
    assert events[-1] == Finished(FinishReason.LENGTH) and len(events) == 3


@BATCHED
def test_without_heartbeats_a_quiet_stream_stalls(batched):
    events = asyncio.run(_collect(BurstyEngine(2, quiet_s=1.5), heartbeat_s=0.0, stall_s=0.5, batched=batched))
    assert len(events) == 1 and isinstance(events[0], EngineError)


async def _post_generate(body: bytes) -> tuple[int, str]:
    import aiohttp

    runner = await start_engine_server(BurstyEngine(1))
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{bound_port(runner)}/generate"
            async with http.post(url, data=body) as r:
                return r.status, await r.text()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"request_id": "", "prompt_token_ids": [1]}',
                                  b'{"request_id": "x", "prompt_token_ids": ["a"]}'])  # fmt: skip
def test_malformed_generate_bodies_get_400(body):
    status, payload = asyncio.run(_post_generate(body))
    assert status == 400 and json.loads(payload)["error"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ('{"max_tokens": "5"}', "params.max_tokens must be an integer, got '5'"),
        ('{"max_tokens": 5.7}', "params.max_tokens must be an integer, got 5.7"),
        ('{"max_tokens": true}', "params.max_tokens must be an integer, got True"),
        ('{"temperature": "1"}', "params.temperature must be a number, got '1'"),
        ('{"top_p": null}', "params.top_p must be a number, got None"),
        ('{"stop_token_ids": [1.5]}', "params.stop_token_ids must be a list of integers, got [1.5]"),
        ('{"stop_token_ids": "12"}', "params.stop_token_ids must be a list of integers, got '12'"),
        ('{"seed": "7"}', "params.seed must be an integer or null, got '7'"),
        ('{"seed": 1.5}', "params.seed must be an integer or null, got 1.5"),
        ('{"seed": 18446744073709551616}', "seed must be null or an integer in [0, 2**63 - 1]"),
        ('{"top_p": 0}', "top_p must be a finite number in (0, 1], got 0"),
        ('{"temperature": 1e999}', "temperature must be a finite number in [0, 2.0], got inf"),
        ('{"temperature": NaN}', "NaN is not a number JSON allows"),
        ('{"top_p": Infinity}', "Infinity is not a number JSON allows"),
        ('{"temperature": -Infinity}', "-Infinity is not a number JSON allows"),
        ('{"topp": 0.5}', "unknown sampling param 'topp'"),
        ("[]", "params must be a JSON object, got []"),
    ],
)
def test_sampling_params_are_never_coerced(params, message):
    body = f'{{"request_id": "x", "prompt_token_ids": [1], "params": {params}}}'.encode()
    status, payload = asyncio.run(_post_generate(body))
    assert status == 400
    assert message in json.loads(payload)["error"]


def test_deeply_nested_json_is_a_400():
    status, payload = asyncio.run(_post_generate(b"[" * 100_000 + b"]" * 100_000))
    assert status == 400
    assert "nested too deeply" in json.loads(payload)["error"]


def test_an_error_message_never_echoes_a_whole_value():
    body = json.dumps({"request_id": "x", "prompt_token_ids": [1], "params": {"seed": "7" * 100_000}}).encode()
    status, payload = asyncio.run(_post_generate(body))
    assert status == 400
    assert len(json.loads(payload)["error"]) < 200


def test_one_abort_call_ends_several_streams_and_leaves_the_others(eventually):
    from reference.engine.base import abort_all, generate
    from reference.engine.fake import FakeEngine

    async def main():
        engine = FakeEngine(token_delay_s=0.01, reply_tokens=100_000)
        runner = await start_engine_server(engine)
        client = HTTPEngine(f"http://127.0.0.1:{bound_port(runner)}")
        try:
            streams = {rid: asyncio.create_task(generate(client, GenerateRequest(rid, (1, 2), SamplingParams(
                max_tokens={"keep": 20}.get(rid, 100_000))))) for rid in ("a", "b", "keep")}  # fmt: skip
            await eventually(lambda: _running(engine, 3), what="3 requests running")
            await abort_all(client, ["a", "b", "not-running"])
            results = {rid: await task for rid, task in streams.items()}
            status, text = await _post("/abort", b'{"request_ids": ["a", 3]}', runner)
            return results, status, text
        finally:
            await client.close()
            await runner.cleanup()

    results, status, text = asyncio.run(main())
    assert results["a"].finish_reason == results["b"].finish_reason == FinishReason.ABORT
    assert results["keep"].finish_reason == FinishReason.LENGTH and len(results["keep"].token_ids) == 20
    assert status == 400 and "request_ids" in text


async def _running(engine, n: int) -> bool:
    """The engine reports `n` requests running (its public stats)."""
    return (await engine.stats()).running == n


async def _post(path: str, body: bytes, runner) -> tuple[int, str]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{bound_port(runner)}{path}", data=body) as r:
            return r.status, await r.text()


# ---- generations started together share one /generate_many stream ----


async def _served(engine, body):
    """Run `body(client)` against `engine` behind a real server; its result, and how many batch streams
    the client opened."""
    runner = await start_engine_server(engine)
    client = HTTPEngine(f"http://127.0.0.1:{bound_port(runner)}")
    batches = []
    run_batch = client._run_batch

    async def counted(entries):
        batches.append(len(entries))
        await run_batch(entries)

    client._run_batch = counted
    try:
        return await body(client), batches
    finally:
        await client.close()
        await runner.cleanup()


def _req(rid: str, prompt=(1, 2), max_tokens: int = 5) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens))


def test_generations_started_together_share_one_stream_and_each_gets_its_own_tokens():
    from reference.engine.base import generate
    from reference.engine.fake import FakeEngine

    requests = [_req(f"s{i}", (1, 2, i), max_tokens=3 + i % 4) for i in range(40)]

    async def body(client):
        return await asyncio.gather(*(generate(client, r) for r in requests))

    results, batches = asyncio.run(_served(FakeEngine(vocab_size=50), body))
    assert batches == [40]
    for r, result in zip(requests, results, strict=True):
        context = list(r.prompt_token_ids)
        for token in result.token_ids:
            assert token == FakeEngine.next_token(context, 0, 50)
            context.append(token)
        assert len(result.token_ids) == r.params.max_tokens and result.finish_reason == FinishReason.LENGTH


def test_a_bad_request_in_a_batch_fails_alone():
    from reference.engine.base import generate
    from reference.engine.fake import FakeEngine

    async def body(client):
        good = [generate(client, _req(f"g{i}")) for i in range(3)]
        bad = generate(client, _req("bad", (1, 999)))  # a token outside the vocabulary
        return await asyncio.gather(*good, bad, return_exceptions=True)

    (*good, bad), batches = asyncio.run(_served(FakeEngine(vocab_size=50), body))
    assert batches == [4]
    assert isinstance(bad, ValueError) and "999" in str(bad)
    assert all(len(g.token_ids) == 5 for g in good)


def test_leaving_one_stream_of_a_batch_aborts_only_its_request(eventually):
    from reference.engine.base import generate
    from reference.engine.fake import FakeEngine

    engine = FakeEngine(token_delay_s=0.01)

    async def body(client):
        async def leave_after_two():
            async with contextlib.aclosing(client.stream(_req("leaver", max_tokens=100_000))) as events:
                return [await anext(events), await anext(events)]

        stay = asyncio.create_task(generate(client, _req("stayer", max_tokens=60)))
        taken = await leave_after_two()
        # the abort reaches the engine and its stream ends (the fake has no public view of one request's state)
        await eventually(lambda: "leaver" not in engine._running, what="the leaver's abort")
        return taken, await stay

    (taken, stayed), batches = asyncio.run(_served(engine, body))
    assert batches == [2] and len(taken) == 2
    assert len(stayed.token_ids) == 60 and stayed.finish_reason == FinishReason.LENGTH


def test_closing_the_client_fails_the_streams_it_still_holds(eventually):
    from reference.engine.base import generate
    from reference.engine.fake import FakeEngine

    engine = FakeEngine(token_delay_s=0.01)

    async def body(client):
        streams = [asyncio.create_task(generate(client, _req(f"s{i}", max_tokens=100_000))) for i in range(3)]
        await eventually(lambda: _running(engine, 3), what="3 requests running")
        await client.close()
        return await asyncio.gather(*streams, return_exceptions=True)

    outcomes, _ = asyncio.run(_served(engine, body))
    assert all(isinstance(o, EngineError) and "closed" in str(o) for o in outcomes), outcomes


def test_a_malformed_batch_body_is_a_400():
    from reference.engine.fake import FakeEngine

    async def main():
        runner = await start_engine_server(FakeEngine())
        try:
            return [await _post("/generate_many", body, runner)
                    for body in (b'{"requests": []}', b'{"requests": {}}', b"[]")]  # fmt: skip
        finally:
            await runner.cleanup()

    for status, text in asyncio.run(main()):
        assert status == 400 and "requests must be a list" in text


def test_a_malformed_request_in_a_batch_gets_its_own_error_line_and_the_others_finish():
    from reference.engine.fake import FakeEngine

    good = {"request_id": "g", "prompt_token_ids": [1, 2], "params": {"max_tokens": 3}}
    bad = {"request_id": "b", "prompt_token_ids": [1, 2], "params": {"max_tokens": "three"}}

    async def main():
        runner = await start_engine_server(FakeEngine())
        try:
            return await _post("/generate_many", json.dumps({"requests": [good, bad]}).encode(), runner)
        finally:
            await runner.cleanup()

    status, text = asyncio.run(main())
    lines = [json.loads(line) for line in text.splitlines()]
    assert status == 200
    (error,) = [d for d in lines if d["r"] == 1]
    assert error["kind"] == "bad_request" and "max_tokens" in error["error"]
    assert sum(len(d.get("t", [])) for d in lines if d["r"] == 0) == 3
    assert {"r": 0, "finish": "length"} in lines
