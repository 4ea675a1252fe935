"""The built-in engine against plain transformers: logits, logprobs, greedy output; and the protocol:
finish reasons, pause / update_weights / resume, abort, cancellation, bad requests, seeds, failures."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest
import torch

from reference.engine.base import (
    EngineError,
    Finished,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    generate,
)
from reference.engine.builtin import BuiltinEngine, sample
from reference.engine.kv_cache import KVCache
from reference.engine.qwen3_forward import Qwen3Runner
from reference.model import build_model, save_checkpoint, score_logprobs, tiny_config
from reference.tokenizer import default_tokenizer

VOCAB = 512
SMALL = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "head_dim": 16}


def tiny(seed: int = 0):
    return build_model(tiny_config(VOCAB, **SMALL), seed)


@pytest.fixture(scope="module")
def model():
    return tiny(0)  # tests that change weights build their own


def req(rid: str, prompt, max_tokens: int = 16, **params) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, **params))


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 37 * i) % VOCAB for i in range(n)]


def sampled_logprobs(model, prompt_ids, token_ids, temperature: float, top_p: float = 1.0) -> list[float]:
    """Each generated token's log-prob under what the engine draws it from, token by token in float64: softmax of
    logits / T (greedy, T = 0: at 1), renormalised over the smallest set of most likely ids whose mass reaches
    top_p."""
    full = list(prompt_ids) + list(token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([full])).logits[0].double()
    out = []
    for i, token in enumerate(token_ids):
        probs = torch.softmax(logits[len(prompt_ids) - 1 + i] / (temperature or 1.0), -1).tolist()
        kept, mass = [], 0.0
        for j in sorted(range(len(probs)), key=lambda j: -probs[j]):
            if mass >= (top_p if temperature else 1.0):
                break
            kept.append(j)
            mass += probs[j]
        assert token in kept, (i, token)
        out.append(math.log(probs[token] / mass))
    return out


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Plain transformers greedy decoding (explicit attention mask: token 0 is a real token here)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


async def take(stream, n: int) -> list[TokenEvent]:
    """The first n events of a stream (all TokenEvents)."""
    out = []
    async for event in stream:
        out.append(event)
        if len(out) == n:
            return out
    raise AssertionError(f"stream ended after {len(out)} events")


# ---- numerics against transformers ----


def test_cache_forward_matches_hf_logits(model):
    """Three sequences of different lengths, one joining three steps late, decoded in one batch."""
    cfg = model.config
    runner = Qwen3Runner(model)
    cache = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, 16, 4, 8192, torch.float32)
    seqs = [prompt(6, 1), prompt(17, 2), prompt(1, 3)]
    cache.ensure(3, 40)
    with torch.inference_mode():
        for step in range(8):
            for slot in {0: [0, 1], 3: [2]}.get(step, []):
                runner.prefill(cache, slot, seqs[slot][:-1])
            live = [0, 1, 2] if step >= 3 else [0, 1]
            logits = runner.decode(cache, [seqs[i][-1] for i in live], [len(seqs[i]) - 1 for i in live])
            for i in live:
                expected = model(torch.tensor([seqs[i]])).logits[0, -1]
                assert (logits[i] - expected).abs().max() < 1e-4, (step, i)
                seqs[i].append(int(expected.argmax()))


def test_logprobs_are_those_of_the_distribution_sampled_from(model):
    """Greedy and sampled requests of different lengths, joining at different steps (max_batch 3): each token's
    log-prob is under softmax(logits / T) after top-p (greedy: at T = 1), as a naive token-by-token scorer says."""

    async def run():
        with BuiltinEngine(model, max_batch=3, seed=1) as engine:
            early = [
                req("g0", prompt(1), 24, temperature=0),
                req("s0", prompt(23, 5), 30, temperature=1.0),
                req("s1", prompt(9, 9), 12, temperature=0.7, top_p=0.9),
            ]
            late = [req("g1", prompt(40, 11), 20, temperature=0), req("s2", prompt(3, 4), 25, temperature=1.3)]
            first = [asyncio.create_task(generate(engine, r)) for r in early]
            async with contextlib.aclosing(engine.stream(req("probe", prompt(4), 6, temperature=0))) as probe:
                await take(probe, 5)  # the probe and the early requests are now mid-generation
            second = [asyncio.create_task(generate(engine, r)) for r in late]
            return await asyncio.gather(*first, *second)

    results = asyncio.run(run())
    params = {"g0": (0, 1), "s0": (1.0, 1), "s1": (0.7, 0.9), "g1": (0, 1), "s2": (1.3, 1)}
    for r in results:
        assert r.finish_reason == FinishReason.LENGTH
        expected = sampled_logprobs(model, r.prompt_token_ids, r.token_ids, *params[r.request_id])
        assert list(r.logprobs) == pytest.approx(expected, abs=1e-4), r.request_id
        assert set(r.versions) == {0}
    full = list(results[1].prompt_token_ids) + list(results[1].token_ids)  # s0, at temperature 1: the plain scorer's
    assert list(results[1].logprobs) == pytest.approx(score_logprobs(model, full)[len(full) - 31 :], abs=1e-4)
    s1 = results[2]  # at 0.7 and top-p 0.9: not the temperature-1 model's
    raw = score_logprobs(model, list(s1.prompt_token_ids) + list(s1.token_ids))[len(s1.prompt_token_ids) - 1 :]
    assert max(abs(a - b) for a, b in zip(s1.logprobs, raw, strict=True)) > 0.05


def test_greedy_matches_hf_generate(model):
    prompts = [prompt(1, 7), prompt(12, 3), prompt(33, 8)]

    async def run():
        with BuiltinEngine(model, max_batch=8) as engine:
            reqs = [req(f"r{i}", p, 20, temperature=0) for i, p in enumerate(prompts)]
            return await asyncio.gather(*(generate(engine, r) for r in reqs))

    for p, result in zip(prompts, asyncio.run(run()), strict=True):
        assert list(result.token_ids) == hf_greedy(model, p, 20)


# ---- finish reasons ----


def test_stop_token_is_included_and_ends_with_stop(model):
    async def run():
        with BuiltinEngine(model) as engine:
            free = await generate(engine, req("a", prompt(5), 20, temperature=0))
            stop = free.token_ids[6]
            stopped = await generate(engine, req("b", prompt(5), 20, temperature=0, stop_token_ids=(stop, VOCAB - 1)))
            return free, stopped, stop

    free, stopped, stop = asyncio.run(run())
    cut = free.token_ids.index(stop) + 1
    assert stopped.token_ids == free.token_ids[:cut] and stopped.token_ids[-1] == stop
    assert stopped.finish_reason == FinishReason.STOP and free.finish_reason == FinishReason.LENGTH


def test_max_tokens_and_full_context_end_with_length(model):
    async def run():
        with BuiltinEngine(model, max_context=20) as engine:
            capped = await generate(engine, req("a", prompt(5), 3))
            full = await generate(engine, req("b", prompt(15), 100))
            last = await generate(engine, req("c", prompt(19), 100))
            return capped, full, last

    capped, full, last = asyncio.run(run())
    assert (len(capped.token_ids), capped.finish_reason) == (3, FinishReason.LENGTH)
    assert (len(full.token_ids), full.finish_reason) == (5, FinishReason.LENGTH)
    assert (len(last.token_ids), last.finish_reason) == (1, FinishReason.LENGTH)


# ---- pause, weight updates, resume ----


def test_pause_update_resume_mid_generation(model):
    p = prompt(10, 2)

    async def run():
        with BuiltinEngine(model) as engine:
            baseline = await generate(engine, req("base", p, 200, temperature=0))
            events = []
            async with contextlib.aclosing(engine.stream(req("x", p, 200, temperature=0))) as stream:
                events += await take(stream, 10)
                await engine.pause()
                await engine.pause()  # idempotent
                steps = (await engine.stats()).extra["steps"]
                await asyncio.sleep(0.2)
                paused = await engine.stats()
                assert paused.paused and paused.running == 1 and paused.extra["steps"] == steps
                await engine.update_weights(1)
                await engine.resume()
                events += [e async for e in stream]
            return baseline, events, await engine.stats()

    baseline, events, stats = asyncio.run(run())
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    versions = [t.version for t in tokens]
    assert events[-1] == Finished(FinishReason.LENGTH) and len(tokens) == 200
    switch = versions.index(1)
    assert switch >= 10 and versions == [0] * switch + [1] * (200 - switch)
    assert [t.token_id for t in tokens] == list(baseline.token_ids)  # same weights: same continuation
    assert stats.extra["reprefills"] == 1 and stats.version == 1 and not stats.paused


def test_update_from_checkpoint_changes_what_is_sampled(tmp_path):
    old, new = tiny(0), tiny(7)
    save_checkpoint(new, default_tokenizer(), tmp_path)
    p = prompt(8, 1)

    async def run():
        with BuiltinEngine(tiny(0)) as engine:
            events = []
            async with contextlib.aclosing(engine.stream(req("x", p, 120, temperature=0))) as stream:
                events += await take(stream, 4)
                await engine.pause()
                await engine.update_weights(3, str(tmp_path))
                await engine.resume()
                events += [e async for e in stream if isinstance(e, TokenEvent)]
            after = await generate(engine, req("y", p, 20, temperature=0))
            return events, after

    events, after = asyncio.run(run())
    full = p + [e.token_id for e in events]
    old_lp, new_lp = score_logprobs(old, full)[len(p) - 1 :], score_logprobs(new, full)[len(p) - 1 :]
    for event, lp_old, lp_new in zip(events, old_lp, new_lp, strict=True):
        assert event.logprob == pytest.approx(lp_old if event.version == 0 else lp_new, abs=1e-4)
    assert {e.version for e in events} == {0, 3}
    assert list(after.token_ids) == hf_greedy(new, p, 20) != hf_greedy(old, p, 20)


def test_load_state_dict_hand_off(model):
    new = tiny(9)

    async def run():
        with BuiltinEngine(tiny(0)) as engine:
            with pytest.raises(RuntimeError, match="load_state_dict needs a paused engine"):
                await engine.load_state_dict(new.state_dict(), 1)
            await engine.pause()
            await engine.load_state_dict(new.state_dict(), 1)
            await engine.resume()
            return await generate(engine, req("a", prompt(6), 10, temperature=0))

    result = asyncio.run(run())
    assert list(result.token_ids) == hf_greedy(new, prompt(6), 10) and set(result.versions) == {1}


def test_update_weights_needs_pause(model, tmp_path):
    async def run():
        with BuiltinEngine(model) as engine:
            with pytest.raises(RuntimeError, match="update_weights needs a paused engine; call pause"):
                await engine.update_weights(1)
            await engine.pause()
            with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
                await engine.update_weights(1, str(tmp_path))
            await engine.resume()
            await engine.resume()  # idempotent
            return await engine.stats()

    stats = asyncio.run(run())
    assert stats.version == 0 and not stats.paused


# ---- abort and cancellation ----


def test_abort_keeps_tokens_and_frees_the_slot(model):
    async def run():
        with BuiltinEngine(model) as engine:
            await engine.abort("nobody")  # unknown id: no-op
            events = []
            stream = engine.stream(req("a", prompt(4), 10_000, temperature=0))
            events += await take(stream, 3)
            await engine.abort("a")
            events += [e async for e in stream]
            return events, await engine.stats()

    events, stats = asyncio.run(run())
    assert events[-1] == Finished(FinishReason.ABORT) and len(events) > 3
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    assert stats.running == 0 and stats.waiting == 0


def test_consumer_going_away_frees_the_slot(model):
    async def run():
        with BuiltinEngine(model, max_batch=2) as engine:
            async with contextlib.aclosing(engine.stream(req("closed", prompt(4), 10_000))) as stream:
                await take(stream, 2)

            async def consume():
                async for _ in engine.stream(req("cancelled", prompt(4), 10_000)):
                    pass

            task = asyncio.create_task(consume())
            await _wait_for(lambda: _running(engine))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = await engine.stats()
            again = await generate(engine, req("closed", prompt(4), 3))  # the id is free again
            return stats, again

    stats, again = asyncio.run(run())
    assert stats.running == 0 and stats.waiting == 0
    assert again.finish_reason == FinishReason.LENGTH


# ---- validation, seeds, batching limits, failures ----


def test_bad_requests_raise_before_anything_is_yielded(model):
    async def first(engine, request):
        return await anext(engine.stream(request))

    async def run():
        with BuiltinEngine(model, max_context=64) as engine:
            for bad, message in [
                (req("a", []), "prompt_token_ids is empty"),
                (req("b", [1, VOCAB]), rf"token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
                (req("c", [-1]), "token id -1 is outside"),
                (req("d", prompt(64)), "prompt of 64 tokens leaves no room in the 64-token context"),
            ]:
                with pytest.raises(ValueError, match=message):
                    await first(engine, bad)
            async with contextlib.aclosing(engine.stream(req("dup", prompt(3), 10_000))) as stream:
                await take(stream, 1)
                with pytest.raises(ValueError, match="request id 'dup' is already running"):
                    await first(engine, req("dup", prompt(3)))
            return await engine.stats()

    assert asyncio.run(run()).running == 0
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        BuiltinEngine(model, max_batch=0)


def test_vocab_limit_is_respected(model):
    async def run():
        with BuiltinEngine(model, vocab_limit=40, seed=3) as engine:
            with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 40\)"):
                await anext(engine.stream(req("a", [45])))
            return await generate(engine, req("b", [1, 2, 3], 200, temperature=2.0))

    assert max(asyncio.run(run()).token_ids) < 40


def test_seeds_make_sampling_deterministic(model):
    def run(engine_seed: int, request_seed: int | None):
        async def go():
            with BuiltinEngine(model, seed=engine_seed) as engine:
                reqs = [req(f"r{i}", prompt(5 + i), 30, temperature=1.0, seed=request_seed) for i in range(3)]
                return [r.token_ids for r in await asyncio.gather(*(generate(engine, r) for r in reqs))]

        return asyncio.run(go())

    assert run(0, None) == run(0, None)
    assert run(0, None) != run(1, None)
    assert run(0, 42) == run(1, 42)


def test_max_batch_limits_running_requests(model):
    async def run():
        with BuiltinEngine(model, max_batch=2) as engine:
            tasks = [asyncio.create_task(generate(engine, req(f"r{i}", prompt(3), 60))) for i in range(5)]
            seen = []

            async def finished() -> bool:
                stats = await engine.stats()
                seen.append((stats.running, stats.waiting))
                return all(t.done() for t in tasks)

            await _wait_for(finished, timeout_s=120)
            return seen, [t.result() for t in tasks]

    seen, results = asyncio.run(run())
    assert max(r for r, _ in seen) == 2
    assert all(len(r.token_ids) == 60 for r in results)


def test_a_decode_step_wakes_each_callers_loop_once(model, monkeypatch):
    """The tokens of one decode step reach their streams in one thread-safe call a loop, not one a token (each
    such call writes to the loop's wake-up socket), and every stream still gets every token in order."""
    from reference.engine import builtin

    calls = []
    original = builtin._put_all
    monkeypatch.setattr(builtin, "_put_all", lambda items: calls.append(len(items)) or original(items))
    requests = [req(f"w{i}", prompt(4, i), 12, temperature=0.0) for i in range(4)]

    async def run():
        with BuiltinEngine(model, max_batch=4) as engine:
            return await _run_queued(engine, requests)

    results = asyncio.run(run())
    assert [len(r.token_ids) for r in results] == [12] * 4
    assert sum(calls) == 48 and len(calls) == 12 and set(calls) == {4}  # 12 steps of the 4 requests together
    for r, q in zip(results, requests, strict=True):
        assert list(r.token_ids) == hf_greedy(model, list(q.prompt_token_ids), 12)


async def _wait_for(condition, timeout_s: float = 30.0) -> None:
    """Poll an async `condition()` until it is true; fail after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(0.005)


async def _running(engine) -> int:
    return (await engine.stats()).running


async def _outcome(task: asyncio.Task):
    """A generate task's result, or the EngineError it raised."""
    try:
        return await task
    except EngineError as e:
        return e


async def _run_queued(engine: BuiltinEngine, requests: list[GenerateRequest]) -> list:
    """Queue `requests` while the engine is paused, so that one step admits them all; their outcomes."""
    await engine.pause()
    tasks = [asyncio.create_task(generate(engine, r)) for r in requests]

    async def all_waiting() -> bool:
        return (await engine.stats()).waiting == len(requests)

    await _wait_for(all_waiting)
    await engine.resume()
    return [await _outcome(t) for t in tasks]


def _fail_once(method, error: Exception, when=lambda *args: True):
    """`method`, except that its first call whose arguments satisfy `when` raises `error`."""
    armed = [True]

    def wrapped(*args):
        if armed[0] and when(*args):
            armed[0] = False
            raise error
        return method(*args)

    return wrapped


def test_a_failed_decode_fails_its_step_and_the_engine_keeps_serving(model):
    async def run():
        with BuiltinEngine(model) as engine:
            engine._runner.decode = _fail_once(engine._runner.decode, RuntimeError("boom"))
            failed = await _run_queued(engine, [req("a", prompt(3)), req("b", prompt(4, 1))])
            later = await generate(engine, req("c", prompt(5, 2), 12, temperature=0))
            return failed, later, await engine.stats()

    failed, later, stats = asyncio.run(run())
    for outcome in failed:
        assert isinstance(outcome, EngineError)
        assert "boom" in str(outcome)
    assert list(later.token_ids) == hf_greedy(model, prompt(5, 2), 12)
    assert (stats.running, stats.waiting) == (0, 0)


def test_a_failed_prefill_fails_only_its_request(model):
    """A context whose prefill always fails (alone or in a batch) fails its request; the requests batched
    with it are prefilled again one by one and answer."""
    bad = prompt(7, 4)

    async def run():
        with BuiltinEngine(model) as engine:
            batched = engine._runner.prefill_batch

            def poisoned(cache, slots, contexts, start=0):
                if any(list(c) == bad[:-1] for c in contexts):
                    raise RuntimeError("bad prefill")
                return batched(cache, slots, contexts, start)

            engine._runner.prefill_batch = poisoned
            good = [req("a", prompt(7, 1), 12, temperature=0), req("c", prompt(9, 2), 12, temperature=0)]
            return await _run_queued(engine, [good[0], req("b", bad), good[1]])

    a, b, c = asyncio.run(run())
    assert isinstance(b, EngineError)
    assert "bad prefill" in str(b)
    assert list(a.token_ids) == hf_greedy(model, prompt(7, 1), 12)
    assert list(c.token_ids) == hf_greedy(model, prompt(9, 2), 12)


def test_samples_of_one_prompt_share_one_prefill_and_equal_lengths_share_a_forward(model):
    """Four greedy samples of one prompt, two of another of the same length and one of a third length,
    admitted in one step: every answer is transformers' greedy decoding, the shared context is computed
    once, and the two contexts of one length go through one forward."""
    first, second, third = prompt(11, 1), prompt(11, 2), prompt(5, 3)
    requests = [req(f"f{i}", first, 8, temperature=0) for i in range(4)]
    requests += [req(f"s{i}", second, 8, temperature=0) for i in range(2)] + [req("t", third, 8, temperature=0)]

    async def run():
        with BuiltinEngine(model, prefix_cache_mb=0) as engine:
            forwards = []
            batched = engine._runner.prefill_batch

            def counted(cache, slots, contexts, start=0):
                forwards.append(len(slots))
                return batched(cache, slots, contexts, start)

            engine._runner.prefill_batch = counted
            outcomes = await _run_queued(engine, requests)
            return outcomes, forwards, await engine.stats()

    outcomes, forwards, stats = asyncio.run(run())
    for r, outcome in zip(requests, outcomes, strict=True):
        assert list(outcome.token_ids) == hf_greedy(model, list(r.prompt_token_ids), 8), r.request_id
    assert sorted(forwards) == [1, 2]  # {first, second} together, third alone
    assert stats.extra["prefill_tokens"] == 10 + 10 + 4  # each distinct context once (its last token is decoded)


def test_a_failing_command_fails_only_its_request(model):
    """A request that slips past validation (here: a seed torch cannot take) fails alone."""
    unseedable = req("a", prompt(3))
    object.__setattr__(unseedable.params, "seed", 2**64)

    async def run():
        with BuiltinEngine(model) as engine:
            with pytest.raises(EngineError, match="request 'a'"):
                await generate(engine, unseedable)
            return await generate(engine, req("b", prompt(3), 5))

    assert asyncio.run(run()).finish_reason == FinishReason.LENGTH


class _Fatal(BaseException):
    """Not an Exception: what the worker cannot survive (as a KeyboardInterrupt would be)."""


def test_worker_death_fails_streams_and_later_calls(model):
    async def run():
        engine = BuiltinEngine(model)

        def broken(*args):
            raise _Fatal("boom")

        engine._runner.decode = broken
        try:
            with pytest.raises(EngineError, match="boom"):
                await generate(engine, req("a", prompt(3)))
            with pytest.raises(EngineError, match="boom"):
                await generate(engine, req("b", prompt(3)))
            with pytest.raises(EngineError):
                await engine.pause()
        finally:
            engine.close()

    asyncio.run(run())


def test_close_ends_open_streams(model):
    async def run():
        engine = BuiltinEngine(model)
        stream = engine.stream(req("a", prompt(3), 10_000))
        await take(stream, 2)
        engine.close()
        with pytest.raises(EngineError, match="closed"):
            async for _ in stream:
                pass

    asyncio.run(run())


def test_default_engine_and_from_checkpoint(tmp_path, model):
    save_checkpoint(model, default_tokenizer(), tmp_path)  # vocab 512 < tokenizer's 4096: fine for loading

    async def run():
        with BuiltinEngine.default(max_batch=4) as engine:
            assert engine.tokenizer is not None and engine.max_context == 8192
            ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
            a = await generate(engine, req("a", ids, 5, stop_token_ids=engine.tokenizer.stop_token_ids))
        with BuiltinEngine.from_checkpoint(tmp_path) as engine:
            b = await generate(engine, req("b", prompt(5), 5, temperature=0))
        return a, b

    a, b = asyncio.run(run())
    assert 1 <= len(a.token_ids) <= 5
    assert list(b.token_ids) == hf_greedy(model, prompt(5), 5)


# ---- the sampler ----


def test_sampler_temperature_top_p_and_processed_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    raw = torch.log_softmax(logits, -1)[0]
    gens = [torch.Generator().manual_seed(0)]
    tokens, lps = sample(logits, [0.0], [1.0], gens)
    assert tokens == [0] and lps[0] == pytest.approx(raw[0].item())  # greedy: at temperature 1, as vLLM
    draws = [sample(logits, [1.0], [1.0], gens)[0][0] for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=5) / 4000
    assert torch.allclose(freq, raw.exp(), atol=0.03)
    nucleus = {sample(logits, [1.0], [0.7], gens)[0][0] for _ in range(300)}
    assert nucleus == {0, 1}  # p = .61, .22, ...: the smallest set reaching 0.7
    for _ in range(20):
        (token,), (lp,) = sample(logits, [1.0], [0.7], gens)
        assert lp == pytest.approx(math.log(raw.exp()[token].item() / raw.exp()[:2].sum().item()), abs=1e-6)
        (token,), (lp,) = sample(logits, [0.5], [1.0], gens)
        assert lp == pytest.approx(torch.log_softmax(logits[0] / 0.5, -1)[token].item(), abs=1e-6)
        (token,), (lp,) = sample(logits, [5.0], [0.7], gens)  # p = .29, .24, .21, .16, .11: three ids reach 0.7
        hot = torch.softmax(logits[0] / 5.0, -1)
        assert token in range(3) and lp == pytest.approx(math.log(hot[token] / hot[:3].sum()), abs=1e-6)
        (token,), (lp,) = sample(logits, [1.0], [1.0], gens, vocab_limit=3)  # the ids it may draw: 0, 1, 2
        assert token in range(3) and lp == pytest.approx(torch.log_softmax(logits[0, :3], -1)[token].item(), abs=1e-6)


def test_raw_logprobs_are_the_temperature_1_models_whatever_was_sampled(model):
    """logprobs_mode="raw" (vLLM's raw_logprobs): the sampler still draws at T and top-p, and reports each token's
    log_softmax(logits) over the ids it may draw; an engine in that mode stores what a plain scorer says."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    raw = torch.log_softmax(logits, -1)[0]
    gens = [torch.Generator().manual_seed(0)]
    drawn = set()
    for _ in range(200):
        (token,), (lp,) = sample(logits, [0.5], [0.7], gens, logprobs_mode="raw")
        drawn.add(token)
        assert lp == pytest.approx(raw[token].item(), abs=1e-6)
    assert drawn == {0}  # at 0.5, p(0) = .84 already reaches top-p 0.7: the draw still follows T and top-p
    (token,), (lp,) = sample(logits, [1.3], [1.0], gens, vocab_limit=3, logprobs_mode="raw")
    assert token in range(3) and lp == pytest.approx(torch.log_softmax(logits[0, :3], -1)[token].item(), abs=1e-6)

    async def run():
        with BuiltinEngine(model, max_batch=2, seed=3, logprobs_mode="raw") as engine:
            return await generate(engine, req("hot", prompt(9, 9), 16, temperature=0.7, top_p=0.9))

    r = asyncio.run(run())
    full = list(r.prompt_token_ids) + list(r.token_ids)
    assert list(r.logprobs) == pytest.approx(score_logprobs(model, full)[len(r.prompt_token_ids) - 1 :], abs=1e-4)
    with pytest.raises(ValueError, match="logprobs_mode must be one of processed, raw, got 'processed_logprobs'"):
        BuiltinEngine(model, logprobs_mode="processed_logprobs")


def test_decode_seconds_count_decode_steps_only(model):
    """`decode_s` grows with decode steps and stays within the calls that made them: the idle time between
    two requests (and the engine's waiting before the first) is not in it."""

    async def run():
        with BuiltinEngine(model) as engine:
            walls = []
            for rid in ("a", "b"):
                start = asyncio.get_running_loop().time()
                await generate(engine, req(rid, prompt(12), 20, temperature=0))
                walls.append(asyncio.get_running_loop().time() - start)
                if rid == "a":
                    first = (await engine.stats()).extra
                    await asyncio.sleep(0.5)  # idle: must not count
            return first, (await engine.stats()).extra, walls

    first, last, walls = asyncio.run(run())
    assert first["steps"] == 20 and last["steps"] == 40
    assert 0 < first["decode_s"] < last["decode_s"] < sum(walls)
