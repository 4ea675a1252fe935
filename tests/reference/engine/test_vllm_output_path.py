"""VLLMEngine on vLLM's own output path, without a GPU: vLLM's `OutputProcessor`, `RequestOutputCollector`,
`SamplingParams`, `tokens_input` and request-id suffix, fed by a fake engine core that emits
`EngineCoreOutput`s (several tokens a step, logprobs, the step's weight-version label, finish reasons).
So DELTA outputs, vLLM's `Logprob` records, `WeightVersionSpan`s on the final output and finish reason
"error" reach the backend exactly as vLLM builds them. Needs vLLM importable (the `gpu` extra), not a
GPU; skipped without it. Checked against the vLLM 0.33.0 sources."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.engine.output_processor")

from vllm.exceptions import VLLMClientError  # noqa: E402
from vllm.inputs import tokens_input  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.sampling_params import SamplingParams as VLLMSamplingParams  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest  # noqa: E402
from vllm.v1.engine import FinishReason as CoreFinish  # noqa: E402
from vllm.v1.engine.input_processor import InputProcessor  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector  # noqa: E402
from vllm.v1.outputs import LogprobsLists  # noqa: E402

from reference.engine.base import EngineError, FinishReason, GenerateRequest, SamplingParams, generate  # noqa: E402
from reference.engine.vllm_engine import VLLMApi, VLLMEngine  # noqa: E402

VOCAB, CTX = 1000, 256


def next_token(ctx, weights):
    return (sum((i + 1) * t for i, t in enumerate(ctx[-8:])) * 31 + len(ctx) * 7 + weights * 101) % VOCAB


def logprob_of(token):
    return -((token % 7) + 1) / 10


class CoreStandIn:
    """`AsyncLLM` over vLLM's real output processing; the engine core is faked: `per_step` tokens a step."""

    def __init__(self, per_step=3, error_after=None):
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=CTX)
        )
        self.processor = OutputProcessor(None, log_stats=False, stream_interval=1)
        self.per_step, self.error_after, self.label, self.weights = per_step, error_after, "default", 0
        self.internal_ids = []
        self.unpaused = asyncio.Event()
        self.unpaused.set()

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        self.unpaused.clear()

    async def resume_generation(self):
        self.unpaused.set()

    async def update_weight_version(self, new_version):
        self.label = new_version

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        return True

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "reload_weights"
        self.weights = int(kwargs["weights_path"].rsplit("w", 1)[1])
        return [None]

    async def abort(self, request_id, internal=False):
        self.processor.abort_requests([request_id], internal)

    async def generate(self, prompt, sampling_params, request_id):
        assert prompt["type"] == "token"
        ids = list(prompt["prompt_token_ids"])
        request = EngineCoreRequest(
            request_id=request_id, prompt_token_ids=ids, mm_features=None, sampling_params=sampling_params.clone(),
            pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
        )  # fmt: skip
        InputProcessor.assign_request_id(request)
        self.internal_ids.append(request.request_id)
        queue = RequestOutputCollector(sampling_params.output_kind, request.request_id)
        self.processor.add_request(request, None, None, 0, queue)
        core = asyncio.create_task(self._core(request.request_id, ids, sampling_params))
        try:
            finished = False
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):  # as AsyncLLM.generate: a cancelled request is aborted
            core.cancel()
            await self.abort(request.request_id, internal=True)
            raise
        finally:
            queue.close()

    async def _core(self, internal_id, ctx, sp):
        made = 0
        while True:
            await self.unpaused.wait()
            await asyncio.sleep(0.002)
            await self.unpaused.wait()
            tokens, reason = [], None
            while len(tokens) < self.per_step and reason is None:
                if self.error_after is not None and made >= self.error_after:
                    reason = CoreFinish.ERROR
                    break
                tokens.append(next_token(ctx, self.weights))
                ctx.append(tokens[-1])
                made += 1
                reason = CoreFinish.STOP if tokens[-1] in sp.stop_token_ids else None
                reason = CoreFinish.LENGTH if reason is None and made == sp.max_tokens else reason
            self.processor.process_outputs([self._output(internal_id, tokens, reason)], time.time(), None, self.label)
            if reason is not None:
                return

    @staticmethod
    def _output(internal_id, tokens, reason):
        k = len(tokens)
        logprobs = LogprobsLists(
            np.array(tokens, dtype=np.int64).reshape(k, 1),
            np.array([logprob_of(t) for t in tokens], dtype=np.float32).reshape(k, 1),
            np.zeros(k, dtype=np.int64),
        )
        return EngineCoreOutput(internal_id, tokens, new_logprobs=logprobs if k else None, finish_reason=reason)

    def shutdown(self):
        pass


def make(**kw):
    llm = CoreStandIn(**kw)
    engine = VLLMEngine.__new__(VLLMEngine)
    api = VLLMApi(VLLMSamplingParams, RequestOutputKind.DELTA, tokens_input, (VLLMClientError,), True)
    engine._attach(llm, api, "auto", 0)
    return engine, llm


def expected(prompt, n, switch_at=None):
    ctx, out = list(prompt), []
    for i in range(n):
        out.append(next_token(ctx, 1 if switch_at is not None and i >= switch_at else 0))
        ctx.append(out[-1])
    return out


def request(rid, **kw):
    return GenerateRequest(rid, (5, 6, 7), SamplingParams(**kw))


def test_several_tokens_an_output_with_their_logprobs_and_a_stop_token():
    engine, llm = make()

    async def main():
        r = await generate(engine, request("a", max_tokens=20, seed=3))
        assert r.finish_reason == FinishReason.LENGTH and list(r.token_ids) == expected((5, 6, 7), 20)
        assert r.logprobs == pytest.approx([logprob_of(t) for t in r.token_ids])
        stop = r.token_ids[7]
        r2 = await generate(engine, request("b", max_tokens=20, stop_token_ids=(stop,)))
        first = r.token_ids.index(stop)
        assert r2.finish_reason == FinishReason.STOP and list(r2.token_ids) == list(r.token_ids[: first + 1])

    asyncio.run(main())
    assert llm.internal_ids[0].startswith("a#0-") and len(llm.internal_ids[0]) == len("a#0-") + 8


def test_vllms_weight_version_spans_agree_with_the_stamps_across_an_update(tmp_path, eventually):
    engine, llm = make()
    (tmp_path / "w1").mkdir()

    async def main():
        events = []

        async def consume():
            async for event in engine.stream(request("p", max_tokens=60)):
                events.append(event)

        task = asyncio.create_task(consume())
        await eventually(lambda: len(events) >= 5, what="5 tokens before the pause")
        await engine.pause()
        await engine.update_weights(1, str(tmp_path / "w1"))
        before = len(events)
        await engine.resume()
        await asyncio.wait_for(task, 10)
        return events, before

    events, before = asyncio.run(main())
    tokens = [e for e in events[:-1]]
    assert [t.token_id for t in tokens] == expected((5, 6, 7), 60, switch_at=before)
    assert [t.version for t in tokens] == [0] * before + [1] * (60 - before)
    assert llm.label == "1" and engine.version_mismatches == 0


def test_a_label_this_engine_never_set_is_counted():
    engine, llm = make()
    llm.label = "7"
    asyncio.run(generate(engine, request("m", max_tokens=6)))
    assert engine.version_mismatches == 6


def test_finish_reason_error_is_an_engine_error_and_abort_by_the_callers_id():
    engine, llm = make(error_after=4)

    async def failing():
        got = []
        with pytest.raises(EngineError, match="finish reason 'error'"):
            async for event in engine.stream(request("e", max_tokens=20)):
                got.append(event)
        return got

    assert len(asyncio.run(failing())) == 4
    engine, llm = make()

    async def aborted():
        stream = engine.stream(request("x", max_tokens=200))
        await anext(stream)
        await engine.abort("x")
        return [event async for event in stream]

    assert asyncio.run(aborted())[-1].reason == FinishReason.ABORT
    assert not llm.processor.has_unfinished_requests()
