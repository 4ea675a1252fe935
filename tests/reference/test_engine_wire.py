"""The engine wire protocol in one process: token batches, heartbeats, in-band errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from reference.engine.base import EngineError, Finished, FinishReason, GenerateRequest, SamplingParams, TokenEvent
from reference.engine.client import HTTPEngine
from reference.engine.server import bound_port, start_engine_server


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


async def _collect(engine, heartbeat_s: float = 5.0, stall_s: float = 60.0) -> list:
    runner = await start_engine_server(engine, heartbeat_s=heartbeat_s)
    client = HTTPEngine(f"http://127.0.0.1:{bound_port(runner)}", stall_timeout_s=stall_s)
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


def test_a_burst_of_tokens_arrives_intact_and_in_order():
    events = asyncio.run(_collect(BurstyEngine(300)))
    assert events[:-1] == [TokenEvent(i, -0.5 * i, 3) for i in range(300)]
    assert events[-1] == Finished(FinishReason.LENGTH)


def test_tokens_before_a_failure_are_delivered_then_the_error():
    events = asyncio.run(_collect(BurstyEngine(5, fail=True)))
    assert events[:5] == [TokenEvent(i, -0.5 * i, 3) for i in range(5)]
    assert isinstance(events[5], EngineError) and "GPU fell off the bus" in str(events[5])


def test_heartbeats_keep_a_quiet_stream_alive():
    events = asyncio.run(_collect(BurstyEngine(2, quiet_s=2.0), heartbeat_s=0.1, stall_s=1.0))
    assert events[-1] == Finished(FinishReason.LENGTH) and len(events) == 3


def test_without_heartbeats_a_quiet_stream_stalls():
    events = asyncio.run(_collect(BurstyEngine(2, quiet_s=1.5), heartbeat_s=0.0, stall_s=0.5))
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


def test_one_abort_call_ends_several_streams_and_leaves_the_others():
    from reference.engine.base import abort_all, generate
    from reference.engine.fake import FakeEngine

    async def main():
        engine = FakeEngine(token_delay_s=0.01, reply_tokens=100_000)
        runner = await start_engine_server(engine)
        client = HTTPEngine(f"http://127.0.0.1:{bound_port(runner)}")
        try:
            streams = {rid: asyncio.create_task(generate(client, GenerateRequest(rid, (1, 2), SamplingParams(
                max_tokens={"keep": 20}.get(rid, 100_000))))) for rid in ("a", "b", "keep")}  # fmt: skip
            while len(engine._running) < 3:
                await asyncio.sleep(0.01)
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


async def _post(path: str, body: bytes, runner) -> tuple[int, str]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{bound_port(runner)}{path}", data=body) as r:
            return r.status, await r.text()
