"""The inference-engine seam: token ids in, token ids + logprobs + policy versions out.

Every backend (built-in, vLLM, the deterministic fake, and the HTTP client that reaches an engine in
another process) implements `InferenceEngine`. The trajectory manager only ever speaks this
protocol, so what it records is exactly what an engine consumed and produced: no text crosses it.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Protocol


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token was sampled (it is included in the output)
    LENGTH = "length"  # max_tokens reached, or the context is full
    ABORT = "abort"  # aborted by the caller; tokens so far are kept


MAX_TEMPERATURE = 2.0
MAX_SEED = 2**63 - 1  # torch's and vLLM's generators take any seed in [0, 2**63 - 1]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; every field is validated on construction (ValueError names the bad value)."""

    max_tokens: int
    temperature: float = 1.0  # in [0, MAX_TEMPERATURE]; 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    stop_token_ids: tuple[int, ...] = ()  # a list is accepted and stored as a tuple
    seed: int | None = None  # in [0, MAX_SEED]; None draws a seed from the engine's seeded RNG

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a finite number in [0, {MAX_TEMPERATURE}], got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a finite number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.stop_token_ids, tuple | list):
            raise ValueError(f"stop_token_ids must be a tuple of integers, got {self.stop_token_ids!r}")
        bad = [t for t in self.stop_token_ids if not _is_int(t)]
        if bad:
            raise ValueError(f"stop_token_ids must be integers, got {bad[0]!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be null or an integer in [0, 2**63 - 1], got {self.seed!r}")


def _is_int(value: object) -> bool:
    if type(value) is int:  # the common case, without the ABC check
        return True
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite real number (not a bool, NaN or an infinity)."""
    if type(value) is float:
        return math.isfinite(value)
    if isinstance(value, bool) or not isinstance(value, Real):
        return False
    return isinstance(value, Integral) or math.isfinite(value)  # isfinite overflows on a huge int


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the engine's logprob of it, and the policy version that sampled it."""

    token_id: int
    logprob: float
    version: int


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Consecutive tokens of one stream, as parallel lists (what `stream_batches` yields): a fast engine's
    tokens then cost the consumer one object per batch, not one per token."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass(frozen=True)
class Finished:
    """The last item of a stream."""

    reason: FinishReason


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason


@dataclass(frozen=True)
class EngineStats:
    """Load and state, for routing and for the control plane."""

    running: int
    waiting: int
    version: int
    paused: bool
    max_context: int
    extra: dict = field(default_factory=dict)


class EngineError(RuntimeError):
    """The engine is unreachable or failed; the caller may retry elsewhere."""


class InferenceEngine(Protocol):
    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | Finished]:
        """Yield each token as it is sampled, then one `Finished`. Raises ValueError for a bad
        request (a prompt longer than the context, a token id outside the vocabulary, a duplicate
        request id) before yielding anything, and EngineError if the engine fails."""
        ...

    async def pause(self) -> None:
        """Stop every running request at a token boundary; keep what it generated."""

    async def update_weights(self, version: int, source: str | None = None) -> None:
        """Load new weights (from `source`, a local checkpoint directory, or the engine's trainer
        hand-off) and label tokens sampled from now on with `version`. Only while paused."""

    async def resume(self) -> None:
        """Re-prefill each unfinished request (prompt + tokens so far) under the current weights and
        continue generating."""

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> EngineStats: ...


def check_request(request: GenerateRequest, vocab_size: int, max_context: int, running=()) -> None:
    """The checks every engine makes before yielding anything; ValueError names the bad value."""
    rid, prompt = request.request_id, request.prompt_token_ids
    if rid in running:
        raise ValueError(f"request id {rid!r} is already running")
    if not prompt:
        raise ValueError(f"request {rid!r}: prompt_token_ids is empty")
    if all(type(t) is int for t in prompt) and min(prompt) >= 0 and max(prompt) < vocab_size:
        bad = []  # the common case, without an ABC check per token
    else:
        bad = [t for t in prompt if not (isinstance(t, Integral) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"request {rid!r}: token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    bad = [t for t in request.params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {rid!r}: stop token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_context:
        raise ValueError(
            f"request {rid!r}: prompt of {len(prompt)} tokens leaves no room in the {max_context}-token context"
        )


def stream_batches(engine: InferenceEngine, request: GenerateRequest) -> AsyncIterator[TokenBatch | Finished]:
    """`engine.stream` as `TokenBatch`es: the engine's own `stream_batches` when it has one (the HTTP
    client: one batch per wire line), else one batch per token."""
    native = getattr(engine, "stream_batches", None)
    return native(request) if native is not None else _one_by_one(engine.stream(request))


async def abort_all(engine: InferenceEngine, request_ids: Sequence[str]) -> None:
    """Abort each of `request_ids` on `engine`: in one call where the engine has `abort_many` (the HTTP
    client: one round trip for a whole preemption), else one `abort` each. Failures are ignored (an
    unreachable engine's requests end with its stream)."""
    if not request_ids:
        return
    many = getattr(engine, "abort_many", None)
    if many is not None:
        await asyncio.gather(many(list(request_ids)), return_exceptions=True)
    else:
        await asyncio.gather(*(engine.abort(r) for r in request_ids), return_exceptions=True)


async def _one_by_one(events: AsyncIterator[TokenEvent | Finished]) -> AsyncIterator[TokenBatch | Finished]:
    try:
        async for event in events:
            yield (
                TokenBatch([event.token_id], [event.logprob], [event.version])
                if isinstance(event, TokenEvent)
                else event
            )
    finally:
        await events.aclose()


async def generate(engine: InferenceEngine, request: GenerateRequest) -> GenerateResult:
    """Collect a whole generation from `engine.stream`."""
    tokens: list[TokenEvent] = []
    reason = FinishReason.ABORT
    async for event in engine.stream(request):
        if isinstance(event, Finished):
            reason = event.reason
        else:
            tokens.append(event)
    return GenerateResult(
        request.request_id,
        request.prompt_token_ids,
        tuple(t.token_id for t in tokens),
        tuple(t.logprob for t in tokens),
        tuple(t.version for t in tokens),
        reason,
    )
