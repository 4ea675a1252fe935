"""A deterministic fake engine for tests and proxy benchmarks, and a scripted one that also replays
demonstrations (`python -m swebench_env replay`: known-good episodes stored as trajectories, whose
logprobs are placeholders). Neither is a model: no user trains on what they generate.

Tokens are a pure function of the context and the policy version, so a test can predict every id;
`token_delay_s` sets its speed. It honours the whole `InferenceEngine` protocol: pause stops every
stream at a token boundary, `update_weights` changes the version stamped on later tokens, `resume`
counts a re-prefill for each unfinished request, `abort` ends a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reference.engine.base import EngineStats, Finished, FinishReason, GenerateRequest, TokenEvent, check_request
from reference.engine.options import check_options, option

if TYPE_CHECKING:
    from reference.engine.backends import EngineSpec


@dataclass(frozen=True)
class FakeConfig:
    """The fake backend's options (its entry in reference/engine/backends.py): how fast it answers, how much."""

    token_delay_s: float = option(0.0, 0, help="seconds per token")
    reply_tokens: int = option(12, 1, help="tokens before it samples a stop token")

    def __post_init__(self) -> None:
        check_options(self)


def from_spec(spec: EngineSpec) -> FakeEngine:
    """The engine an engine process serves for the "fake" backend, over the default tokenizer's vocabulary."""
    from reference.tokenizer import default_tokenizer

    options: FakeConfig = spec.options
    vocab = default_tokenizer().vocab_size
    return FakeEngine(vocab_size=vocab, token_delay_s=options.token_delay_s, reply_tokens=options.reply_tokens)


class FakeEngine:
    def __init__(
        self,
        vocab_size: int = 1000,
        max_context: int = 8192,
        token_delay_s: float = 0.0,
        reply_tokens: int = 12,
        stop_token_id: int | None = None,
    ) -> None:
        self.vocab_size, self.max_context = vocab_size, max_context
        self.token_delay_s, self.reply_tokens, self.stop_token_id = token_delay_s, reply_tokens, stop_token_id
        self.version = 0
        self.reprefills = 0  # requests re-prefilled by `resume` (partial rollout)
        self.consumed: dict[str, tuple[int, ...]] = {}  # request id -> prompt it received
        self._running: dict[str, list[int]] = {}  # request id -> context so far
        self._aborted: set[str] = set()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._kick = asyncio.Event()  # set by abort: wakes paused streams to look at `_aborted`

    def running_contexts(self) -> dict[str, tuple[int, ...]]:
        """A snapshot of the requests under way: request id -> its context so far (prompt + tokens). Safe from
        another thread (a test's, while the engine's loop generates): each copy is made without releasing
        the GIL."""
        return {rid: tuple(ctx) for rid, ctx in list(self._running.items())}

    @staticmethod
    def next_token(context: list[int] | tuple[int, ...], version: int, vocab_size: int) -> int:
        """The token this engine samples after `context` under policy `version`."""
        tail = sum((i + 1) * t for i, t in enumerate(context[-8:]))
        return (tail * 31 + len(context) * 7 + version * 101) % vocab_size

    @staticmethod
    def logprob(token_id: int) -> float:
        return -((token_id % 97) + 1) / 10.0

    def _check(self, request: GenerateRequest) -> None:
        check_request(request, self.vocab_size, self.max_context, self._running)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | Finished]:
        self._check(request)
        context = list(request.prompt_token_ids)
        self._running[request.request_id] = context
        self.consumed[request.request_id] = request.prompt_token_ids
        stop = set(request.params.stop_token_ids) | ({self.stop_token_id} if self.stop_token_id is not None else set())
        limit = min(request.params.max_tokens, self.max_context - len(context))
        reason = FinishReason.LENGTH
        try:
            for n in range(limit):
                await self._wait_unpaused(request.request_id)
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                    await self._wait_unpaused(request.request_id)
                if request.request_id in self._aborted:
                    reason = FinishReason.ABORT
                    break
                token = self._token(request, context, n, stop)
                context.append(token)
                yield TokenEvent(token, self.logprob(token), self.version)
                if token in stop:
                    reason = FinishReason.STOP
                    break
            yield Finished(reason)
        finally:
            self._running.pop(request.request_id, None)
            self._aborted.discard(request.request_id)

    async def _wait_unpaused(self, request_id: str) -> None:
        """Until the engine is unpaused or this request is aborted (an abort ends a paused request too)."""
        while not self._unpaused.is_set() and request_id not in self._aborted:
            self._kick.clear()
            unpaused = asyncio.ensure_future(self._unpaused.wait())
            kicked = asyncio.ensure_future(self._kick.wait())
            await asyncio.wait((unpaused, kicked), return_when=asyncio.FIRST_COMPLETED)
            unpaused.cancel()
            kicked.cancel()

    def _token(self, request: GenerateRequest, context: list[int], n: int, stop: set[int]) -> int:
        """The n-th token of this request's reply (after `context`)."""
        if n + 1 == self.reply_tokens and stop:
            return min(stop)
        return self.next_token(context, self.version, self.vocab_size)

    async def pause(self) -> None:
        self._unpaused.clear()

    async def update_weights(self, version: int, source: str | None = None) -> None:
        if self._unpaused.is_set():
            raise RuntimeError("update_weights needs a paused engine; call pause() first")
        self.version = version

    async def resume(self) -> None:
        self.reprefills += len(self._running)
        self._unpaused.set()

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)
            self._kick.set()

    async def stats(self) -> EngineStats:
        return EngineStats(len(self._running), 0, self.version, not self._unpaused.is_set(), self.max_context)


class ScriptedEngine(FakeEngine):
    """A fake whose replies are scripted: `script(prompt_token_ids)` returns the reply's token ids, which
    are emitted in order (then a stop token, if the request has one and the reply does not end on it).
    For testing agents and parsers on exact model output, and for replaying demonstrations through the
    manager (swebench_env/scripted.py); everything else is `FakeEngine`'s."""

    def __init__(self, script: Callable[[tuple[int, ...]], Sequence[int]], **kw) -> None:
        super().__init__(**kw)
        self.script = script
        self._replies: dict[str, list[int]] = {}

    def _token(self, request: GenerateRequest, context: list[int], n: int, stop: set[int]) -> int:
        reply = self._replies.get(request.request_id)
        if reply is None or n == 0:
            reply = self._replies[request.request_id] = list(self.script(request.prompt_token_ids))
        if n < len(reply):
            return reply[n]
        return min(stop) if stop else self.next_token(context, self.version, self.vocab_size)
