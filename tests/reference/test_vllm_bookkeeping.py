"""VLLMEngine's own bookkeeping (both partial-rollout modes, abort, validation, the context cap) on the CPU,
against a stand-in with vLLM's `AsyncLLM` interface. The stand-in encodes what the vLLM source says
(`generate` streams DELTA outputs and aborts on cancel; "keep" pause freezes requests and
clear_cache preempts them for recompute); the real engine is exercised by the gpu-marked tests in
test_vllm_engine.py."""

import asyncio
from types import SimpleNamespace

import pytest

from reference.engine.base import Finished, FinishReason, GenerateRequest, SamplingParams, TokenEvent, generate
from reference.engine.vllm_engine import VLLMEngine

VOCAB, CTX = 1000, 256


def next_token(ctx, weights):
    return (sum((i + 1) * t for i, t in enumerate(ctx[-8:])) * 31 + len(ctx) * 7 + weights * 101) % VOCAB


class SP:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class StandInLLM:
    """Samples next_token(context, weights); keep-pause freezes, clear_cache preempts (recompute)."""

    def __init__(self, keep=True, delay=0.002):
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=CTX)
        )
        self.weights, self.delay = 0, delay
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.live, self.aborted, self.prefills, self.submitted = set(), set(), 0, []
        if keep:

            async def pause_generation(*, mode="abort", wait_for_inflight_requests=None, clear_cache=True):
                assert mode == "keep" and clear_cache
                self.unpaused.clear()
                self.prefills += len(self.live)  # preempted -> recompute on resume

            async def resume_generation():
                self.unpaused.set()

            self.pause_generation, self.resume_generation = pause_generation, resume_generation

    async def generate(self, prompt, sampling_params, request_id):
        sp = sampling_params
        assert sp.ignore_eos and sp.logprobs == 0 and sp.detokenize is False
        ctx = list(prompt["prompt_token_ids"])
        self.submitted.append((request_id, len(ctx), sp.max_tokens, sp.seed))
        assert request_id not in self.live
        self.live.add(request_id)
        self.prefills += 1
        try:
            for n in range(sp.max_tokens):
                await self.unpaused.wait()
                await asyncio.sleep(self.delay)
                await self.unpaused.wait()
                if request_id in self.aborted:
                    yield SimpleNamespace(
                        outputs=[SimpleNamespace(token_ids=[], logprobs=[], finish_reason="abort")], finished=True
                    )
                    return
                t = next_token(ctx, self.weights)
                ctx.append(t)
                stop = t in sp.stop_token_ids
                last = stop or n + 1 == sp.max_tokens or len(ctx) >= CTX
                reason = "stop" if stop else ("length" if last else None)
                lp = {t: SimpleNamespace(logprob=-((t % 7) + 1) / 10)}
                yield SimpleNamespace(
                    outputs=[SimpleNamespace(token_ids=[t], logprobs=[lp], finish_reason=reason)], finished=last
                )
                if last:
                    return
        finally:
            self.live.discard(request_id)

    async def abort(self, request_id):
        self.aborted.add(request_id)

    async def collective_rpc(self, method, args=()):
        assert method == "seamlessflow_load_weights"
        self.weights = int(args[0].rsplit("w", 1)[1])
        return [1]

    async def reset_prefix_cache(self):
        return not self.live or not self.unpaused.is_set()

    def shutdown(self):
        pass


def make(mode):
    llm = StandInLLM(keep=(mode == "keep"))
    eng = VLLMEngine.__new__(VLLMEngine)
    eng._attach(llm, SP, "DELTA", "auto")
    assert eng.pause_mode == mode, eng.pause_mode
    return eng, llm


def req(rid, prompt=(5, 6, 7), **kw):
    kw.setdefault("max_tokens", 2)
    return GenerateRequest(rid, tuple(prompt), SamplingParams(**kw))


def expected(prompt, n, switch_at=None):
    ctx, out = list(prompt), []
    for i in range(n):
        w = 1 if switch_at is not None and i >= switch_at else 0
        t = next_token(ctx, w)
        ctx.append(t)
        out.append(t)
    return out


@pytest.fixture(params=["keep", "resubmit"])
def engine(request):
    return make(request.param)


def test_generation_and_stop_tokens(engine):
    eng, _ = engine

    async def main():
        r = await generate(eng, req("a", max_tokens=20))
        assert r.finish_reason == FinishReason.LENGTH and list(r.token_ids) == expected((5, 6, 7), 20)
        assert set(r.versions) == {0} and all(lp < 0 for lp in r.logprobs)
        stop = r.token_ids[5]
        first = r.token_ids.index(stop)
        r2 = await generate(eng, req("b", max_tokens=20, stop_token_ids=(stop,)))
        assert r2.finish_reason == FinishReason.STOP and list(r2.token_ids) == list(r.token_ids[: first + 1])

    asyncio.run(main())


def test_partial_rollout_across_a_weight_update(engine, tmp_path):
    eng, _ = engine
    (tmp_path / "w1").mkdir()

    async def main():
        events = []

        async def consume():
            async for ev in eng.stream(req("p", max_tokens=60)):
                events.append(ev)

        task = asyncio.create_task(consume())
        while len(events) < 5:
            await asyncio.sleep(0.001)
        await eng.pause()
        assert (await eng.stats()).paused
        await eng.update_weights(1, str(tmp_path / "w1"))
        await asyncio.sleep(0.05)
        n_before = len(events)
        await eng.resume()
        await asyncio.wait_for(task, 10)
        return events, n_before

    events, n_before = asyncio.run(main())
    toks = [e for e in events if isinstance(e, TokenEvent)]
    assert events[-1] == Finished(FinishReason.LENGTH) and len(toks) == 60
    versions = [t.version for t in toks]
    k = versions.count(0)
    assert versions == [0] * k + [1] * (60 - k) and 5 <= k < 60 and k == n_before
    assert [t.token_id for t in toks] == expected((5, 6, 7), 60, switch_at=k)  # new weights after the update
    assert eng.reprefills == 1


def test_abort_early_exit_and_paused_start(engine):
    eng, llm = engine

    async def main():
        events = []
        async for ev in eng.stream(req("x", max_tokens=200)):
            events.append(ev)
            if len(events) == 3:
                await eng.abort("x")
        assert events[-1] == Finished(FinishReason.ABORT) and 3 <= len(events) - 1 < 200
        agen = eng.stream(req("c", max_tokens=200))
        async for _ in agen:
            break
        await agen.aclose()
        await asyncio.sleep(0.05)
        s = await eng.stats()
        assert s.running == 0 and s.waiting == 0 and not llm.live
        await eng.pause()
        t = asyncio.create_task(generate(eng, req("w", max_tokens=10)))
        await asyncio.sleep(0.05)
        assert not t.done()
        await eng.update_weights(1)
        await eng.resume()
        r = await asyncio.wait_for(t, 5)
        assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 10 and set(r.versions) == {1}

    asyncio.run(main())


def test_abort_while_paused_and_context_cap(engine):
    eng, llm = engine

    async def main():
        events = []

        async def consume():
            async for ev in eng.stream(req("q", max_tokens=100)):
                events.append(ev)

        task = asyncio.create_task(consume())
        while len(events) < 3:
            await asyncio.sleep(0.001)
        await eng.pause()
        await eng.abort("q")
        await eng.resume()
        await asyncio.wait_for(task, 5)
        assert events[-1] == Finished(FinishReason.ABORT)
        r = await generate(eng, req("L", prompt=(1,) * (CTX - 4), max_tokens=50))
        assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 4
        await asyncio.sleep(0.05)
        assert not llm.live

    asyncio.run(main())


def test_bad_requests_and_update_without_pause(engine):
    eng, _ = engine

    async def main():
        for bad in [
            req("e", prompt=()),
            req("e", prompt=(VOCAB,)),
            req("e", prompt=(-1,)),
            req("e", prompt=(1,) * CTX),
        ]:
            with pytest.raises(ValueError):
                await generate(eng, bad)
        agen = eng.stream(req("d", max_tokens=200))
        await agen.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await generate(eng, req("d", max_tokens=2))
        await agen.aclose()
        with pytest.raises(RuntimeError, match="pause"):
            await eng.update_weights(3)

    asyncio.run(main())
