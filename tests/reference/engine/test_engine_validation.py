"""What every engine refuses: sampling params outside their ranges (checked on construction), stop
tokens outside the vocabulary, and a request that once killed the built-in engine (a seed >= 2**64)."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest

from reference.engine.base import MAX_SEED, GenerateRequest, SamplingParams, generate
from reference.engine.builtin import BuiltinEngine
from reference.engine.fake import FakeEngine
from reference.engine.server import start_engine_server
from reference.engine.sockets import bound_port
from reference.model import build_model, tiny_config

VOCAB = 512
SMALL = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "head_dim": 16}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", True, r"max_tokens must be an integer >= 1, got True"),
        ("max_tokens", 5.0, r"max_tokens must be an integer >= 1, got 5.0"),
        ("max_tokens", "5", r"max_tokens must be an integer >= 1, got '5'"),
        ("temperature", math.nan, r"temperature must be a finite number in \[0, 2.0\], got nan"),
        ("temperature", math.inf, r"temperature must be a finite number in \[0, 2.0\], got inf"),
        ("temperature", 2.5, r"temperature must be a finite number in \[0, 2.0\], got 2.5"),
        ("temperature", False, r"temperature must be a finite number in \[0, 2.0\], got False"),
        ("top_p", math.nan, r"top_p must be a finite number in \(0, 1\], got nan"),
        ("top_p", "1", r"top_p must be a finite number in \(0, 1\], got '1'"),
        ("stop_token_ids", (1, 2.0), r"stop_token_ids must be integers, got 2.0"),
        ("stop_token_ids", (True,), r"stop_token_ids must be integers, got True"),
        ("stop_token_ids", "12", r"stop_token_ids must be a tuple of integers, got '12'"),
        ("seed", 2**64, r"seed must be null or an integer in \[0, 2\*\*63 - 1\], got 18446744073709551616"),
        ("seed", MAX_SEED + 1, r"seed must be null or an integer in \[0, 2\*\*63 - 1\]"),
        ("seed", -1, r"seed must be null or an integer in \[0, 2\*\*63 - 1\], got -1"),
        ("seed", 1.0, r"seed must be null or an integer in \[0, 2\*\*63 - 1\], got 1.0"),
        ("seed", True, r"seed must be null or an integer in \[0, 2\*\*63 - 1\], got True"),
    ],
)
def test_sampling_params_reject_bad_values(field, value, message):
    kwargs = {"max_tokens": 4, field: value}
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges_of_their_ranges():
    low = SamplingParams(max_tokens=1, temperature=0, top_p=1e-9, stop_token_ids=[3, 4], seed=0)
    high = SamplingParams(max_tokens=10**6, temperature=2, top_p=1, seed=MAX_SEED)
    assert low.stop_token_ids == (3, 4)
    assert (high.temperature, high.seed) == (2, MAX_SEED)


def _outside_vocab_stop() -> GenerateRequest:
    return GenerateRequest("s", (1, 2), SamplingParams(max_tokens=4, stop_token_ids=(3, VOCAB)))


def test_the_fake_engine_rejects_a_stop_token_outside_the_vocabulary():
    async def run():
        await anext(FakeEngine(vocab_size=VOCAB).stream(_outside_vocab_stop()))

    with pytest.raises(ValueError, match=rf"stop token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"):
        asyncio.run(run())


@pytest.fixture(scope="module")
def engine_model():
    return build_model(tiny_config(VOCAB, **SMALL), 0)


def test_the_builtin_engine_rejects_a_stop_token_outside_the_vocabulary(engine_model):
    async def run():
        with BuiltinEngine(engine_model) as engine:
            await anext(engine.stream(_outside_vocab_stop()))

    with pytest.raises(ValueError, match=rf"stop token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"):
        asyncio.run(run())


def test_a_seed_torch_cannot_take_is_a_400_and_the_engine_keeps_serving(engine_model):
    body = {"request_id": "big", "prompt_token_ids": [1, 2], "params": {"max_tokens": 3, "seed": 2**64}}

    async def run():
        with BuiltinEngine(engine_model) as engine:
            runner = await start_engine_server(engine)
            try:
                async with aiohttp.ClientSession() as http:
                    url = f"http://127.0.0.1:{bound_port(runner)}/generate"
                    async with http.post(url, json=body) as r:
                        status, payload = r.status, await r.text()
                later = await generate(engine, GenerateRequest("later", (1, 2), SamplingParams(max_tokens=3)))
            finally:
                await runner.cleanup()
            return status, payload, later

    status, payload, later = asyncio.run(run())
    assert status == 400
    assert "seed must be null or an integer in [0, 2**63 - 1]" in payload
    assert len(later.token_ids) == 3
