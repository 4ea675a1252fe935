"""Prefix caching in the built-in engine: reused KV gives exactly what recomputing gives, and never
survives a weight update."""

from __future__ import annotations

import asyncio
from array import array

import pytest
import torch

from reference.engine.base import GenerateRequest, SamplingParams, generate
from reference.engine.builtin import BuiltinEngine
from reference.engine.prefix_cache import PrefixCache, common_prefix
from reference.model import build_model, tiny_config

VOCAB = 512
SMALL = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "head_dim": 16}


def kv(n: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((2, 1, n, 4), fill)  # [layers, kv_heads, n, head_dim]: 32 bytes a token each


def ids(n: int, first: int = 1) -> list[int]:
    return [first, *range(100, 100 + n - 1)]


def test_common_prefix_counts_tokens():
    x, y = array("I", [1, 2, 3, 4]).tobytes(), array("I", [1, 2, 9]).tobytes()
    assert common_prefix(x, y) == 2 and common_prefix(x, x) == 4 and common_prefix(x, b"") == 0


def test_lookup_put_supersede_and_evict():
    cache = PrefixCache(max_bytes=64 * 40, min_match=4)  # room for 40 tokens
    cache.put(ids(10), kv(10), kv(10))
    cache.put(ids(20), kv(20), kv(20))  # the 10-token entry is a prefix of it: superseded
    assert len(cache) == 1 and cache.nbytes == 64 * 20
    n, k, _ = cache.lookup([*ids(15), 7, 7])
    assert n == 15 and k.shape[2] == 20
    assert cache.lookup(ids(3)) is None  # shorter than min_match
    assert cache.lookup([9, 9, 9, 9, 9]) is None
    cache.put(ids(15, first=2), kv(15), kv(15))
    cache.put(ids(15, first=3), kv(15), kv(15))  # 20 + 15 + 15 > 40: the least recently used goes
    assert len(cache) == 2 and cache.lookup(ids(20)) is None
    assert cache.lookup(ids(15, first=2))[0] == 15
    cache.put(ids(100, first=4), kv(100), kv(100))  # larger than the whole cache: not kept
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


def run_turns(engine: BuiltinEngine, base: list[int]) -> list:
    """Turn 1 on `base`, turn 2 on turn 1's whole sequence plus new tokens (an agent's next turn)."""

    async def main():
        first = await generate(engine, GenerateRequest("t1", tuple(base), SamplingParams(max_tokens=12)))
        second_prompt = (*base, *first.token_ids, 5, 6, 7)
        second = await generate(engine, GenerateRequest("t2", second_prompt, SamplingParams(max_tokens=12, seed=3)))
        return [first, second, await engine.stats()]

    return asyncio.run(main())


def test_reused_prefix_gives_the_same_tokens_and_logprobs():
    model = build_model(tiny_config(VOCAB, **SMALL), seed=0)
    base = [(11 + 37 * i) % VOCAB for i in range(60)]
    with BuiltinEngine(model, prefix_cache_mb=0) as cold, BuiltinEngine(model) as warm:
        c1, c2, cold_stats = run_turns(cold, base)
        w1, w2, warm_stats = run_turns(warm, base)
    assert w1.token_ids == c1.token_ids and w2.token_ids == c2.token_ids
    assert w2.logprobs == pytest.approx(c2.logprobs, abs=1e-4)
    reused = warm_stats.extra["prefix_cache_hit_tokens"]
    assert cold_stats.extra["prefix_cache_hit_tokens"] == 0 and reused == len(base) + len(w1.token_ids) - 1
    assert warm_stats.extra["prefill_tokens"] == cold_stats.extra["prefill_tokens"] - reused


def test_weight_update_empties_the_prefix_cache():
    model = build_model(tiny_config(VOCAB, **SMALL), seed=0)
    base = [(3 + 17 * i) % VOCAB for i in range(40)]

    async def main(engine):
        await generate(engine, GenerateRequest("a", tuple(base), SamplingParams(max_tokens=8)))
        await engine.pause()
        await engine.update_weights(1)
        await engine.resume()
        before = (await engine.stats()).extra["prefix_cache_hit_tokens"]
        await generate(engine, GenerateRequest("b", (*base, 9), SamplingParams(max_tokens=8)))
        return before, await engine.stats()

    with BuiltinEngine(model) as engine:
        before, stats = asyncio.run(main(engine))
    assert before == 0 and stats.extra["prefix_cache_hit_tokens"] == 0
    assert stats.extra["prefix_cache_entries"] == 1  # only "b", computed under the new weights
