"""VLLMEngine on real vLLM, checked against an fp32 transformers forward of the same tiny Qwen3.

The `gpu` tests need vLLM (the `gpu` extra: vLLM 0.33) and an NVIDIA GPU (`make test-gpu`); each runs
once per pause mode ("keep" is skipped on a vLLM without it). Two random checkpoints stand for policy
versions: a token counts as sampled by a version when, given everything before it, that checkpoint
ranks it first (up to a bf16-sized near-tie) and gives it the logprob vLLM reported. The CPU tests need no vLLM.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import random
from pathlib import Path

import pytest

from reference.engine.base import Finished, FinishReason, GenerateRequest, SamplingParams, TokenEvent, generate
from reference.engine.vllm_engine import GPU_EXTRA_HINT, VLLMEngine

VOCAB = 2048
MAX_MODEL_LEN = 1024
PROMPT = tuple(random.Random(0).randrange(2, VOCAB) for _ in range(16))
NEAR_TIE = 0.5  # nats: bf16 vLLM and fp32 transformers may order tokens closer than this differently
LOGPROB_TOL = 0.5  # nats: |vLLM logprob - fp32 transformers logprob| of a token (bf16 on CPU: <= 0.21)
TIMEOUT_S = 300

gpu = pytest.mark.gpu


def _write_checkpoint(path: Path, seed: int) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked next-token distributions: few near-ties under bf16
    model.to(torch.bfloat16).save_pretrained(path)
    _write_tokenizer(path)
    return path


def _write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the vocabulary, for a vLLM that loads one despite skip_tokenizer_init."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t0", eos_token="t1")
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[int, Path]:
    """Two random tiny Qwen3 checkpoints (bf16 safetensors), seeds 0 and 1."""
    pytest.importorskip("vllm")
    return {seed: _write_checkpoint(tmp_path_factory.mktemp(f"qwen3-tiny-{seed}"), seed) for seed in (0, 1)}


@pytest.fixture(scope="session")
def reference_models(checkpoints):
    """fp32 transformers copies of the checkpoints, on the CPU."""
    from transformers import Qwen3ForCausalLM

    return {seed: Qwen3ForCausalLM.from_pretrained(path).float().eval() for seed, path in checkpoints.items()}


@pytest.fixture(scope="module")
def loop():
    """vLLM's output handler lives on one event loop, so every call to an engine runs on this one."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module", params=["keep", "resubmit"])
def engine(request, loop, checkpoints):
    async def make() -> VLLMEngine:
        return VLLMEngine(
            str(checkpoints[0]),
            max_model_len=MAX_MODEL_LEN,
            gpu_memory_utilization=0.3,
            enforce_eager=True,
            dtype="bfloat16",
            pause_mode=request.param,
        )

    try:
        engine = loop.run_until_complete(make())
    except ValueError as e:
        if "pause_mode='keep'" in str(e):
            pytest.skip(f"this vLLM cannot pause in keep mode: {e}")
        raise
    yield engine
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0.1))  # let cancelled vLLM tasks finish before the loop closes


def run(loop, coroutine):
    return loop.run_until_complete(asyncio.wait_for(coroutine, TIMEOUT_S))


def _reference_logprobs(model, context, tokens, temperature: float = 1.0):
    """[len(tokens), V]: `model`'s log-softmax of logits / `temperature` before each token, in fp32."""
    import torch

    ids = torch.tensor([[*context, *tokens[:-1]]])
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, len(context) - 1 :].float() / temperature, dim=-1)


def _assert_sampled_by(model, context, tokens, logprobs, *, greedy: bool, temperature: float = 1.0) -> None:
    """Each token, given `context` + the tokens before it, is `model`'s first choice (greedy, up to a
    near-tie) and has the logprob `model` gives it at `temperature` (what vLLM sampled from)."""
    reference = _reference_logprobs(model, context, tokens, temperature)
    for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        row = reference[i]
        if greedy:
            best = int(row.argmax())
            assert row[token] >= row[best] - NEAR_TIE, f"token {i}: {token}, but the reference picks {best}"
        assert abs(logprob - float(row[token])) < LOGPROB_TOL, f"token {i}: logprob {logprob} vs {float(row[token])}"


async def _load(engine: VLLMEngine, checkpoint: Path) -> int:
    """Pause, load `checkpoint` as the next version, resume; returns that version."""
    version = (await engine.stats()).version + 1
    await engine.pause()
    await engine.update_weights(version, str(checkpoint))
    await engine.resume()
    return version


async def _first_event(engine: VLLMEngine, request: GenerateRequest):
    stream = engine.stream(request)
    try:
        return await anext(stream)
    finally:
        await stream.aclose()


@gpu
def test_greedy_matches_transformers(engine, loop, reference_models):
    request = GenerateRequest("greedy", PROMPT, SamplingParams(max_tokens=32, temperature=0.0))
    result = run(loop, generate(engine, request))
    assert result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == 32
    assert len(set(result.versions)) == 1
    _assert_sampled_by(reference_models[0], PROMPT, result.token_ids, result.logprobs, greedy=True)


@gpu
def test_sampled_logprobs_are_finite_nonpositive_and_match_the_model(engine, loop, reference_models):
    request = GenerateRequest("sampled", PROMPT, SamplingParams(max_tokens=64, temperature=1.0, seed=7))
    result = run(loop, generate(engine, request))
    assert len(result.token_ids) == 64
    assert all(math.isfinite(lp) and lp <= 1e-6 for lp in result.logprobs)
    _assert_sampled_by(reference_models[0], PROMPT, result.token_ids, result.logprobs, greedy=False)


@gpu
def test_logprobs_are_of_the_temperature_scaled_distribution(engine, loop, reference_models):
    """At temperature 2 each token's logprob is the model's under softmax(logits / 2) (processed_logprobs), and
    nearer to it than to the temperature-1 model's."""
    request = GenerateRequest("hot", PROMPT, SamplingParams(max_tokens=64, temperature=2.0, seed=11))
    result = run(loop, generate(engine, request))
    model, ids = reference_models[0], result.token_ids
    _assert_sampled_by(model, PROMPT, ids, result.logprobs, greedy=False, temperature=2.0)
    error = {}
    for t in (1.0, 2.0):
        rows = _reference_logprobs(model, PROMPT, ids, t)
        pairs = enumerate(zip(ids, result.logprobs, strict=True))
        error[t] = sum(abs(lp - float(rows[i, token])) for i, (token, lp) in pairs) / len(ids)
    assert error[2.0] < error[1.0] / 4, error


@gpu
def test_stop_token_ends_the_stream_and_is_included(engine, loop):
    free = run(loop, generate(engine, GenerateRequest("free", PROMPT, SamplingParams(max_tokens=16, temperature=0))))
    tokens = list(free.token_ids)
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(tokens[at],))
    stopped = run(loop, generate(engine, GenerateRequest("stopped", PROMPT, params)))
    assert stopped.finish_reason == FinishReason.STOP
    assert list(stopped.token_ids) == tokens[: at + 1]


async def _partial_rollout(engine: VLLMEngine, new_weights: Path, max_tokens: int, eventually):
    """Pause a greedy generation after a few tokens, load `new_weights`, resume; returns (old version,
    events)."""
    version = (await engine.stats()).version
    request = GenerateRequest("partial", PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    events: list[TokenEvent | Finished] = []

    async def consume() -> None:
        async for event in engine.stream(request):
            events.append(event)

    consumer = asyncio.create_task(consume())
    await eventually(lambda: len(events) >= 4 or consumer.done(), timeout_s=120, what="4 tokens before the pause")
    assert not consumer.done(), "the request finished before it could be paused"
    await engine.pause()
    assert (await engine.stats()).paused
    await engine.update_weights(version + 1, str(new_weights))
    await engine.resume()
    await consumer
    return version, events


@gpu
def test_pause_update_resume_switches_version_mid_generation(engine, loop, checkpoints, reference_models, eventually):
    n = 300
    try:
        version, events = run(loop, _partial_rollout(engine, checkpoints[1], n, eventually))
    finally:
        run(loop, _load(engine, checkpoints[0]))  # the other tests expect the first checkpoint
    assert events[-1] == Finished(FinishReason.LENGTH)
    tokens = events[:-1]
    assert len(tokens) == n and all(isinstance(t, TokenEvent) for t in tokens)
    versions = [t.version for t in tokens]
    before = versions.count(version)
    assert versions == [version] * before + [version + 1] * (n - before)
    assert 4 <= before < n
    ids, logprobs = [t.token_id for t in tokens], [t.logprob for t in tokens]
    _assert_sampled_by(reference_models[0], PROMPT, ids[:before], logprobs[:before], greedy=True)
    # after resume: the new weights, over a prefix recomputed with them (stale KV would fail this)
    context = (*PROMPT, *ids[:before])
    _assert_sampled_by(reference_models[1], context, ids[before:], logprobs[before:], greedy=True)
    extra = run(loop, engine.stats()).extra
    assert extra["reprefills"] >= 1
    assert extra["version_mismatches"] == 0  # vLLM's own weight-version labels agree with every stamp
    assert extra["weight_loader"] == "reload_weights"  # vLLM 0.33's workers reload in place


async def _start_while_paused(engine: VLLMEngine):
    await engine.pause()
    try:
        request = GenerateRequest("late", PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
        task = asyncio.create_task(generate(engine, request))
        await asyncio.sleep(0.5)
        assert not task.done(), "a request ran while the engine was paused"
    finally:
        await engine.resume()
    return await task


@gpu
def test_request_started_while_paused_runs_after_resume(engine, loop):
    result = run(loop, _start_while_paused(engine))
    assert result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == 8


@gpu
def test_update_weights_needs_a_paused_engine(engine, loop):
    with pytest.raises(RuntimeError, match="paused"):
        run(loop, engine.update_weights(99))


async def _abort_after(engine: VLLMEngine, request: GenerateRequest, n_tokens: int):
    events = []
    async for event in engine.stream(request):
        events.append(event)
        if len(events) == n_tokens:
            await engine.abort(request.request_id)
    return events


@gpu
def test_abort_ends_the_stream_with_abort_keeping_tokens(engine, loop):
    request = GenerateRequest("aborted", PROMPT, SamplingParams(max_tokens=900, temperature=1.0, seed=3))
    events = run(loop, _abort_after(engine, request, 3))
    assert events[-1] == Finished(FinishReason.ABORT)
    assert 3 <= len(events) - 1 < 900
    assert run(loop, engine.stats()).running == 0


async def _leave_early(engine: VLLMEngine, request: GenerateRequest):
    stream = engine.stream(request)
    async for _ in stream:
        break
    await stream.aclose()
    await asyncio.sleep(0.5)  # vLLM aborts the request in the background
    return await engine.stats()


@gpu
def test_leaving_a_stream_aborts_the_vllm_request(engine, loop):
    request = GenerateRequest("left", PROMPT, SamplingParams(max_tokens=900))
    stats = run(loop, _leave_early(engine, request))
    assert stats.running == 0 and stats.waiting == 0
    assert not engine.vllm_engine.output_processor.has_unfinished_requests()
    again = GenerateRequest("left", PROMPT, SamplingParams(max_tokens=2))
    assert len(run(loop, generate(engine, again)).token_ids) == 2


async def _duplicate(engine: VLLMEngine) -> None:
    first = engine.stream(GenerateRequest("dup", PROMPT, SamplingParams(max_tokens=900)))
    await anext(first)
    try:
        await _first_event(engine, GenerateRequest("dup", PROMPT, SamplingParams(max_tokens=2)))
    finally:
        await first.aclose()


@gpu
@pytest.mark.parametrize(
    "prompt", [(), (VOCAB,), (-1,), (5,) * MAX_MODEL_LEN], ids=["empty", "past-vocab", "negative", "no-room"]
)
def test_bad_request_raises_value_error_before_any_token(engine, loop, prompt):
    with pytest.raises(ValueError):
        run(loop, _first_event(engine, GenerateRequest("bad", prompt, SamplingParams(max_tokens=4))))


def _bypassing_validation(**fields) -> SamplingParams:
    """Sampling params as a caller that got around SamplingParams' checks would send them."""
    params = SamplingParams(max_tokens=8, temperature=1.0)
    for key, value in fields.items():
        object.__setattr__(params, key, value)
    return params


@gpu
def test_a_request_vllm_rejects_raises_value_error_and_the_engine_keeps_serving(engine, loop):
    hot = GenerateRequest("hot", PROMPT, _bypassing_validation(temperature=2.5))  # vLLM: temperature in [0, 2]
    with pytest.raises(ValueError, match="temperature"):
        run(loop, _first_event(engine, hot))
    after = GenerateRequest("after", PROMPT, SamplingParams(max_tokens=2))
    assert len(run(loop, generate(engine, after)).token_ids) == 2


@gpu
def test_seeds_outside_int64_and_minus_one_are_mapped_and_reproducible(engine, loop):
    def tokens(rid, seed):
        request = GenerateRequest(rid, PROMPT, _bypassing_validation(seed=seed))
        return run(loop, generate(engine, request)).token_ids

    top = tokens("top", 2**63 - 1)
    assert tokens("top-again", 2**63 - 1) == top  # seeded: the same draws
    assert tokens("minus-one", -1) == top  # -1 is mapped to 2**63 - 1, not read by vLLM as "unseeded"
    assert len(tokens("huge", 2**64 - 1)) == 8  # would overflow vLLM's int64 seed array
    assert run(loop, engine.stats()).running == 0


@gpu
def test_duplicate_running_id_raises_value_error(engine, loop):
    with pytest.raises(ValueError, match="already running"):
        run(loop, _duplicate(engine))


@gpu
def test_stats_when_idle(engine, loop):
    stats = run(loop, engine.stats())
    assert (stats.running, stats.waiting, stats.paused, stats.max_context) == (0, 0, False, MAX_MODEL_LEN)
    assert stats.extra["pause_mode"] == engine.pause_mode


def test_module_imports_without_vllm_and_the_constructor_says_how_to_get_it():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed")
    with pytest.raises(ImportError) as raised:
        VLLMEngine("/no/such/model")
    assert str(raised.value) == GPU_EXTRA_HINT and ".[gpu]" in GPU_EXTRA_HINT


def test_unknown_pause_mode_is_rejected_before_vllm_loads():
    with pytest.raises(ValueError, match="'auto', 'keep', 'resubmit'"):
        VLLMEngine("/no/such/model", pause_mode="sometimes")
