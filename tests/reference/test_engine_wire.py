"""The engine wire protocol in one process: token batches, heartbeats, in-band errors."""

from __future__ import annotations

import asyncio

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


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"request_id": "", "prompt_token_ids": [1]}',
                                  b'{"request_id": "x", "prompt_token_ids": ["a"]}'])  # fmt: skip
def test_malformed_generate_bodies_get_400(body):
    import aiohttp

    async def main():
        runner = await start_engine_server(BurstyEngine(1))
        try:
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{bound_port(runner)}/generate"
                async with http.post(url, data=body) as r:
                    return r.status, await r.json()
        finally:
            await runner.cleanup()

    status, payload = asyncio.run(main())
    assert status == 400 and payload["error"]
