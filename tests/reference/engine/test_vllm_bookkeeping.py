"""VLLMEngine's own bookkeeping (both partial-rollout modes, abort, validation, the context cap, the mapping of
vLLM's errors, seeds and weight-version labels) on the CPU, against a stand-in with vLLM's `AsyncLLM`
interface. The stand-in encodes what the vLLM 0.33.0 source says: `generate` takes a token input and
streams DELTA outputs, several tokens to an output when asked, and aborts on cancel; request ids get a
random suffix inside while outputs and `abort` use the caller's; invalid requests raise a client error
that is not a ValueError; finish reason "error" ends a failed request; a seed of -1 means unseeded and
one outside int64 kills the worker; "keep" pause freezes requests and clear_cache preempts them for
recompute; each step is labelled with the version `update_weight_version` set, the spans returned on
the final output. The real engine is exercised by the gpu-marked tests in test_vllm_engine.py."""

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from reference.engine.base import (
    EngineError,
    Finished,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    generate,
)
from reference.engine.vllm_engine import LOGPROBS_MODE, VLLMApi, VLLMEngine, check_vllm_version, engine_args

VOCAB, CTX = 1000, 256


def next_token(ctx, weights):
    return (sum((i + 1) * t for i, t in enumerate(ctx[-8:])) * 31 + len(ctx) * 7 + weights * 101) % VOCAB


class ClientError(Exception):
    """vLLM's VLLMClientError: a bad request, deliberately not a ValueError (as in vLLM 0.33)."""


class DeadError(Exception):
    """vLLM's EngineDeadError."""


class TokensIn(dict):
    """vLLM's token input (`vllm.inputs.tokens_input`): a rendered prompt, not a raw dict."""

    def __init__(self, ids):
        super().__init__(type="token", prompt_token_ids=list(ids))


class SP:
    """vLLM's SamplingParams: validated on construction; a seed of -1 means none."""

    def __init__(self, **kw):
        if kw["temperature"] > 2.0:
            raise ClientError(f"temperature must be in [0, 2], got {kw['temperature']}.")
        kw["seed"] = None if kw["seed"] == -1 else kw["seed"]
        self.__dict__.update(kw)


class StandInLLM:
    """Samples next_token(context, weights); keep-pause freezes, clear_cache preempts (recompute)."""

    def __init__(self, keep=True, delay=0.002, tokens_per_output=1):
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=CTX)
        )
        self.weights, self.delay, self.per_output = 0, delay, tokens_per_output
        self.label = "default"  # vLLM's label before the first update_weight_version
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.live, self.aborted, self.prefills, self.submitted, self.rpcs = {}, set(), 0, [], []
        self.dead = False
        self.fail_with: Exception | None = None  # raised by the next generate
        self.error_after: int | None = None  # finish reason "error" after this many tokens
        self.mislabel: str | None = None  # a label to report instead of the real one
        self._suffix = itertools.count()
        if keep:

            async def pause_generation(*, mode="abort", clear_cache=True):
                assert mode == "keep" and clear_cache
                self.unpaused.clear()
                self.prefills += len(self.live)  # preempted -> recompute on resume

            async def resume_generation():
                self.unpaused.set()

            self.pause_generation, self.resume_generation = pause_generation, resume_generation

    def _admit(self, prompt, sp, request_id):
        """What vLLM checks before running a request; returns its internal id."""
        if self.dead:
            raise DeadError("EngineCore encountered an issue.")
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        assert isinstance(prompt, TokensIn), f"a raw prompt reached vLLM: {prompt!r}"
        assert sp.ignore_eos and sp.logprobs == 0 and sp.detokenize is False and sp.output_kind == "DELTA"
        ids = prompt["prompt_token_ids"]
        if not ids or len(ids) >= CTX or not all(0 <= t < VOCAB for t in ids):
            raise ClientError(f"prompt of {len(ids)} tokens rejected")
        if sp.seed is not None and not -(2**63) <= sp.seed < 2**63:  # the worker's int64 seed array
            self.dead = True
            raise DeadError("EngineCore encountered an issue.")
        internal = f"{request_id}-{next(self._suffix):08x}"  # vLLM's random suffix
        self.submitted.append((request_id, len(ids), sp.max_tokens, sp.seed))
        return internal

    async def generate(self, prompt, sampling_params, request_id):
        sp = sampling_params
        internal = self._admit(prompt, sp, request_id)
        ctx = list(prompt["prompt_token_ids"])
        self.live[internal] = request_id
        self.prefills += 1
        labels, chunk = [], []
        try:
            for n in range(sp.max_tokens):
                await self.unpaused.wait()
                await asyncio.sleep(self.delay)
                await self.unpaused.wait()
                if internal in self.aborted:
                    yield self._output(request_id, [], "abort", True)
                    return
                if self.error_after is not None and n >= self.error_after:
                    yield self._output(request_id, chunk, "error", True)
                    return
                t = next_token(ctx, self.weights)
                ctx.append(t)
                chunk.append(t)
                labels.append(self.mislabel or self.label)
                stop = t in sp.stop_token_ids
                last = stop or n + 1 == sp.max_tokens or len(ctx) >= CTX
                if last or len(chunk) == self.per_output:
                    reason = "stop" if stop else ("length" if last else None)
                    yield self._output(request_id, chunk, reason, last, _spans(labels) if last else None)
                    chunk = []
                if last:
                    return
        finally:
            self.live.pop(internal, None)

    @staticmethod
    def _output(request_id, tokens, reason, finished, spans=None):
        logprobs = [{t: SimpleNamespace(logprob=-((t % 7) + 1) / 10)} for t in tokens]
        completion = SimpleNamespace(token_ids=list(tokens), logprobs=logprobs, finish_reason=reason)
        completion.weight_versions = spans
        return SimpleNamespace(request_id=request_id, outputs=[completion], finished=finished)

    async def abort(self, request_id):
        self.aborted.update(i for i, external in self.live.items() if external == request_id)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        path = kwargs["weights_path"] if method == "reload_weights" else args[0]
        assert method in ("reload_weights", "seamlessflow_load_weights")
        self.rpcs.append(method)
        self.weights = int(path.rsplit("w", 1)[1])
        return [None]

    async def update_weight_version(self, new_version):
        assert isinstance(new_version, str)
        self.label = new_version

    async def reset_prefix_cache(self):
        return not self.live or not self.unpaused.is_set()

    def shutdown(self):
        pass


def _spans(labels):
    """Contiguous (version, start, end) spans, as vLLM's WeightVersionSpan."""
    spans = []
    for i, label in enumerate(labels):
        if spans and spans[-1].version == label:
            spans[-1].end = i + 1
        else:
            spans.append(SimpleNamespace(version=label, start=i, end=i + 1))
    return spans


def make(mode, reload_weights=True, seed=0, **llm_kw):
    llm = StandInLLM(keep=(mode == "keep"), **llm_kw)
    eng = VLLMEngine.__new__(VLLMEngine)
    eng._attach(llm, VLLMApi(SP, "DELTA", TokensIn, (ClientError,), reload_weights), "auto", seed)
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


async def _partial_rollout(eng, checkpoint, eventually, max_tokens=60):
    """Pause after 5 tokens, load `checkpoint` as version 1, resume; returns (events, tokens before resume)."""
    events = []

    async def consume():
        async for ev in eng.stream(req("p", max_tokens=max_tokens)):
            events.append(ev)

    task = asyncio.create_task(consume())
    await eventually(lambda: len(events) >= 5, what="5 tokens before the pause")
    await eng.pause()
    assert (await eng.stats()).paused
    await eng.update_weights(1, str(checkpoint))
    await asyncio.sleep(0.05)  # a window for a token still in transit to land (none may: the count below)
    n_before = len(events)
    await eng.resume()
    await asyncio.wait_for(task, 10)
    return events, n_before


@pytest.mark.parametrize("tokens_per_output", [1, 3])
@pytest.mark.parametrize("mode", ["keep", "resubmit"])
def test_partial_rollout_across_a_weight_update(mode, tokens_per_output, tmp_path, eventually):
    eng, llm = make(mode, tokens_per_output=tokens_per_output)
    (tmp_path / "w1").mkdir()
    events, n_before = asyncio.run(_partial_rollout(eng, tmp_path / "w1", eventually))
    toks = [e for e in events if isinstance(e, TokenEvent)]
    assert events[-1] == Finished(FinishReason.LENGTH) and len(toks) == 60
    versions = [t.version for t in toks]
    k = versions.count(0)
    assert versions == [0] * k + [1] * (60 - k) and 5 <= k < 60 and k == n_before
    assert [t.token_id for t in toks] == expected((5, 6, 7), 60, switch_at=k)  # new weights after the update
    assert eng.reprefills == 1
    assert llm.label == "1" and eng.version_mismatches == 0  # vLLM's labels agree with every stamp


async def _idle(eng, llm) -> bool:
    """Nothing running or waiting in the engine, and no request left inside the stand-in vLLM."""
    s = await eng.stats()
    return s.running == 0 and s.waiting == 0 and not llm.live


def test_abort_early_exit_and_paused_start(engine, eventually):
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
        await eventually(lambda: _idle(eng, llm), what="the early exit to free the request in vLLM")
        await eng.pause()
        t = asyncio.create_task(generate(eng, req("w", max_tokens=10)))
        await asyncio.sleep(0.05)  # a paused engine must not serve it in this window
        assert not t.done()
        await eng.update_weights(1)
        await eng.resume()
        r = await asyncio.wait_for(t, 5)
        assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 10 and set(r.versions) == {1}

    asyncio.run(main())


def test_abort_while_paused_and_context_cap(engine, eventually):
    eng, llm = engine

    async def main():
        events = []

        async def consume():
            async for ev in eng.stream(req("q", max_tokens=100)):
                events.append(ev)

        task = asyncio.create_task(consume())
        await eventually(lambda: len(events) >= 3, what="3 tokens before the pause")
        await eng.pause()
        await eng.abort("q")
        await eng.resume()
        await asyncio.wait_for(task, 5)
        assert events[-1] == Finished(FinishReason.ABORT)
        r = await generate(eng, req("L", prompt=(1,) * (CTX - 4), max_tokens=50))
        assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 4
        await eventually(lambda: not llm.live, what="vLLM to drop the capped request")

    asyncio.run(main())


def test_bad_requests_and_update_without_pause(engine):
    eng, _ = engine

    async def main():
        for bad in [
            req("e", prompt=()),
            req("e", prompt=(VOCAB,)),
            req("e", prompt=(-1,)),
            req("e", prompt=(1,) * CTX),
            req("e", stop_token_ids=(VOCAB,)),
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


def _bypassing_validation(**fields) -> SamplingParams:
    """Sampling params as a caller that got around SamplingParams' checks would send them."""
    params = SamplingParams(max_tokens=8)
    for key, value in fields.items():
        object.__setattr__(params, key, value)
    return params


def test_vllm_rejections_become_value_errors_and_engine_trouble_engine_errors(engine):
    eng, llm = engine
    assert not issubclass(ClientError, ValueError)

    async def main():
        llm.fail_with = ClientError("stop_token_ids out of range")  # vLLM's input processor refuses it
        with pytest.raises(ValueError, match="vLLM rejected request 'r1': stop_token_ids") as raised:
            await generate(eng, req("r1"))
        assert isinstance(raised.value.__cause__, ClientError)
        hot = GenerateRequest("r2", (5, 6, 7), _bypassing_validation(temperature=2.5))  # vLLM's SamplingParams
        with pytest.raises(ValueError, match="temperature must be in"):
            await generate(eng, hot)
        for trouble in (DeadError("EngineCore encountered an issue."), RuntimeError("queue full")):
            llm.fail_with = trouble
            with pytest.raises(EngineError) as raised:
                await generate(eng, req("r3"))
            assert not isinstance(raised.value, ValueError) and raised.value.__cause__ is trouble
        assert (await generate(eng, req("r4"))).finish_reason == FinishReason.LENGTH  # still serving

    asyncio.run(main())


@pytest.mark.parametrize("tokens_per_output", [1, 3])
def test_finish_reason_error_raises_engine_error_after_the_tokens(engine, tokens_per_output):
    eng, llm = engine
    llm.per_output, llm.error_after = tokens_per_output, 4

    async def main():
        events = []
        with pytest.raises(EngineError, match="finish reason 'error'"):
            async for event in eng.stream(req("err", max_tokens=20)):
                events.append(event)
        assert [e.token_id for e in events] == expected((5, 6, 7), 4)  # no Finished(ABORT)

    asyncio.run(main())


SEEDS = [0, 7, 2**63 - 1, -1, 2**63, 2**64 - 1]  # the last three only from a caller that bypassed validation


@pytest.mark.parametrize("mode", ["keep", "resubmit"])
def test_vllm_gets_every_seed_in_int64_and_never_minus_one(mode, tmp_path, eventually):
    eng, llm = make(mode)
    (tmp_path / "w1").mkdir()

    async def main():
        for i, seed in enumerate(SEEDS):
            r = await generate(eng, GenerateRequest(f"s{i}", (5, 6, 7), _bypassing_validation(seed=seed)))
            assert r.finish_reason == FinishReason.LENGTH
        await _partial_rollout(eng, tmp_path / "w1", eventually)  # resubmit: a continuation gets its own seed

    asyncio.run(main())
    sent = [seed for *_, seed in llm.submitted]
    assert all(seed is not None and 0 <= seed < 2**63 for seed in sent), sent
    assert not llm.dead
    assert sent[:3] == SEEDS[:3] and sent[3] == 2**63 - 1  # -1 is a seed like any other, not "none"


def test_requests_without_a_seed_get_one_from_the_engine_seed():
    def seeds(engine_seed):
        eng, llm = make("keep", seed=engine_seed)

        async def main():
            for i in range(3):
                await generate(eng, req(f"n{i}", temperature=1.0))

        asyncio.run(main())
        return [seed for *_, seed in llm.submitted]

    first = seeds(0)
    assert first == seeds(0) and first != seeds(1)
    assert all(seed is not None and 0 <= seed < 2**63 for seed in first)


def test_vllm_suffixes_request_ids_inside_and_the_caller_id_still_aborts(engine):
    eng, llm = engine

    async def main():
        stream = eng.stream(req("mine", max_tokens=200))
        await anext(stream)
        (internal,) = llm.live
        assert internal != "mine#0" and internal.startswith("mine#0-")
        await eng.abort("mine")
        assert [e async for e in stream][-1] == Finished(FinishReason.ABORT)
        assert not llm.live

    asyncio.run(main())


def test_a_token_vllm_labels_with_another_version_is_counted(engine):
    eng, llm = engine
    llm.mislabel = "7"  # a label this engine never set

    async def main():
        await generate(eng, req("m", max_tokens=5))
        return await eng.stats()

    assert asyncio.run(main()).extra["version_mismatches"] == 5 == eng.version_mismatches


@pytest.mark.parametrize("reload_weights, method", [(True, "reload_weights"), (False, "seamlessflow_load_weights")])
def test_weights_load_through_vllms_reload_where_it_exists(reload_weights, method, tmp_path):
    eng, llm = make("keep", reload_weights=reload_weights)
    (tmp_path / "w1").mkdir()

    async def main():
        await eng.pause()
        await eng.update_weights(1, str(tmp_path / "w1"))
        await eng.resume()
        return await eng.stats()

    stats = asyncio.run(main())
    assert llm.rpcs == [method] and llm.weights == 1 and stats.extra["weight_loader"] == method
    assert llm.label == "1" and stats.version == 1


def test_logprobs_mode_is_processed_unless_raw_is_asked_for():
    """vLLM reports the log-probs of what it sampled from (after temperature and top-p) by default, as the trainer
    scores; "raw" (temperature 1) by name; the logits modes are refused."""
    args = engine_args("/models/qwen3", max_model_len=1024, dtype="bfloat16")
    assert args["logprobs_mode"] == LOGPROBS_MODE == "processed_logprobs" and args["dtype"] == "bfloat16"
    for given, vllm_name in [
        ("processed", "processed_logprobs"),
        ("processed_logprobs", "processed_logprobs"),
        ("raw", "raw_logprobs"),
        ("raw_logprobs", "raw_logprobs"),
    ]:
        assert engine_args("/m", logprobs_mode=given)["logprobs_mode"] == vllm_name
    for other in ("raw_logits", "processed_logits", "processed_logprob", None):
        with pytest.raises(
            ValueError,
            match=f"logprobs_mode must be one of processed, processed_logprobs, raw, raw_logprobs .*got {other!r}",
        ):
            engine_args("/m", logprobs_mode=other)
        with pytest.raises(ValueError, match="logprobs_mode must be one of"):  # before vLLM is imported
            VLLMEngine("/no/such/model", logprobs_mode=other)


@pytest.mark.parametrize("version", ["0.33.0", "0.10.2", "0.10.2rc1", "0.11.0.dev5+g1234abc", "1.0"])
def test_a_vllm_whose_processed_logprobs_follow_the_temperature_is_taken(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.10.1.1", "0.10.0", "0.9.2", "not-a-version"])
def test_an_older_vllm_is_refused_naming_its_version(version):
    with pytest.raises(ImportError) as raised:
        check_vllm_version(version)
    assert str(raised.value).startswith("the vllm backend needs vLLM >= 0.10.2 (logprobs_mode='processed_logprobs'")
    assert f"found vLLM {version};" in str(raised.value)
