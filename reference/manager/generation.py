"""Generation: one agent request's tokens from the engines, continued across engine failures, then recorded.

If an engine fails mid-generation, the request continues on another engine from where it stopped
(prompt + tokens so far, as partial rollout does after a weight update); the agent only sees a
slower answer. If no engine is left, the request fails with a 503 and nothing is recorded. A request
the engine rejects as invalid is the agent's fault: a 400, never retried elsewhere. A request is recorded
only when it finishes: durably first, then in the tree (`recorder.py`), and only then does the agent get
its answer (`Outcome`).

`Generation` is a base class of `TrajectoryManager`; it shares the calls in flight (`_progress`, and the
ids `preempt` and `restart_older_than` abort in `_migrating` and `_restarting`) with `fleet.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reference.engine.base import (
    EngineError,
    Finished,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenBatch,
    stream_batches,
)
from reference.manager.chat import IncrementalDecoder, RequestError, Sampling, find_stop
from reference.manager.errors import StoreError, store_unavailable
from reference.manager.recorder import Recorder
from reference.manager.records import NewTurn
from reference.manager.router import EngineSlot, NoEngineAvailable, Router
from reference.manager.sessions import Session

if TYPE_CHECKING:
    from reference.manager.config import ManagerConfig
    from reference.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """A finished, recorded request."""

    session_id: str
    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    text: str
    finish_reason: str
    cached_tokens: int  # prompt tokens already in the session's tree, up to the end of a generated run
    branch_id: int
    engines: tuple[str, ...]


@dataclass
class Progress:
    """A request's generated tokens so far, over every engine it ran on."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    engines: list[str]
    restartable: bool = False  # no text of it reached the agent yet, so it may start over from its prompt

    def truncate(self, n: int) -> None:
        """Keep the first `n` generated tokens: ids, log-probs and versions are cut together (the store
        refuses a record whose three lists differ in length)."""
        for values in (self.token_ids, self.logprobs, self.versions):
            del values[n:]


class Generation:
    """The manager's generation of agent requests (see the module docstring); each is checked against the
    context by `Admission.budget`."""

    config: ManagerConfig
    tok: Tokenizer
    router: Router
    recorder: Recorder
    _progress: dict[str, Progress]  # engine request id -> its request's progress
    _migrating: set[str]  # engine request ids aborted by `preempt`, to continue elsewhere
    _restarting: set[str]  # engine request ids aborted to start over from their prompt
    _serving_changed: asyncio.Event
    _stop_ids: tuple[int, ...]
    _request_prefix: str
    _request_numbers: Iterator[int]

    async def complete(self, session: Session, prompt: Sequence[int], sampling: Sampling) -> Outcome:
        """The recorded `Outcome` of one request, without text pieces (what a non-streaming answer needs).
        `session` must be held (`accepted`); cancelling aborts the engine request and records nothing."""
        if sampling.stream or sampling.stop:
            async with aclosing(self.generate(session, prompt, sampling)) as items:
                async for item in items:
                    if isinstance(item, Outcome):
                        return item
            raise RuntimeError("generation ended without an outcome")
        prompt, progress, request_id = tuple(prompt), Progress([], [], [], [], True), self._new_request_id()
        max_tokens = self.budget(len(prompt), sampling)
        reason = "abort"
        batches = self._engines(session.session_id, request_id, prompt, sampling, max_tokens, progress)
        try:
            async for item in batches:
                if isinstance(item, Finished):
                    reason = str(item.reason)
        finally:
            await batches.aclose()  # (aclosing's work, without its object on every request)
        stops = self._stops(sampling)
        text = self.tok.decode([t for t in progress.token_ids if t not in stops])
        return await self._record(session, request_id, prompt, progress, text, reason)

    async def generate(
        self, session: Session, prompt: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[str | Outcome]:
        """Yield text pieces as tokens arrive, then the recorded `Outcome`. `session` must be held
        (`accepted`). Closing the iterator early (the agent went away) aborts the engine request;
        nothing is recorded for it."""
        prompt = tuple(prompt)
        max_tokens = self.budget(len(prompt), sampling)
        request_id = self._new_request_id()
        decoder = IncrementalDecoder(self.tok, skip_ids=self._stops(sampling))
        progress = Progress([], [], [], [])
        held = max((len(s) for s in sampling.stop), default=1) - 1  # text withheld while a stop may be forming
        emitted, reason, text = 0, "abort", None
        batches = self._engines(session.session_id, request_id, prompt, sampling, max_tokens, progress)
        async with aclosing(batches) as items:
            async for item in items:
                if isinstance(item, Finished):
                    reason = str(item.reason)
                    break
                for token_id in item.token_ids:
                    decoder.push(token_id)
                    if sampling.stop and (cut := find_stop(decoder.text, sampling.stop, max(0, emitted - held))) >= 0:
                        reason, text = "stop", decoder.text[:cut]
                        break
                if text is not None:
                    progress.truncate(len(decoder.ids))  # tokens after the stop string are not the answer
                    break
                if len(decoder.text) - held > emitted:
                    yield decoder.text[emitted : len(decoder.text) - held]
                    emitted = len(decoder.text) - held
        if text is None:
            decoder.flush()
            text = decoder.text
            if sampling.stop and (cut := find_stop(text, sampling.stop, max(0, emitted - held))) >= 0:
                reason, text = "stop", text[:cut]
        if len(text) > emitted:
            yield text[emitted:]
        yield await self._record(session, request_id, prompt, progress, text, reason)

    def _new_request_id(self) -> str:
        """`req-` and 20 hex digits, unique across manager restarts (a random 48-bit prefix per process)."""
        return f"req-{self._request_prefix}{next(self._request_numbers):08x}"

    def _stops(self, sampling: Sampling) -> tuple[int, ...]:
        """The ids that end a sample and are left out of its text: none with `ignore_eos`, where they are
        ordinary tokens (sampled, counted and shown like any other) and only `max_tokens` ends a sample."""
        return () if sampling.ignore_eos else self._stop_ids

    async def _engines(
        self,
        session_id: str,
        request_id: str,
        prompt: tuple[int, ...],
        sampling: Sampling,
        max_tokens: int,
        progress: Progress,
    ) -> AsyncIterator[TokenBatch | Finished]:
        """The engine's tokens for one request (also appended to `progress`), continued on another engine
        from the tokens so far if one fails or is preempted (a preemption is not a failure: it costs no
        attempt)."""
        excluded: set[str] = set()
        failures = calls = 0
        while failures < self.config.max_engine_attempts:
            slot = await self._choose(session_id, excluded)
            params = SamplingParams(
                max_tokens=max_tokens - len(progress.token_ids),
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                stop_token_ids=self._stops(sampling),
                seed=sampling.seed,
            )
            call = GenerateRequest(f"{request_id}.{calls}", prompt + tuple(progress.token_ids), params)
            calls += 1
            self.router.acquire(slot)
            slot.calls.add(call.request_id)
            self._progress[call.request_id] = progress
            progress.engines.append(slot.name)
            stream = stream_batches(slot.engine, call)
            try:
                async for item in stream:
                    if isinstance(item, TokenBatch):
                        slot.tokens += len(item.token_ids)
                        progress.token_ids += item.token_ids
                        progress.logprobs += item.logprobs
                        progress.versions += item.versions
                        yield item
                        continue
                    if item.reason is FinishReason.ABORT and call.request_id in self._restarting:
                        for tokens in (progress.token_ids, progress.logprobs, progress.versions):
                            tokens.clear()
                        break  # its tokens were too old to train on: start over from the prompt
                    if item.reason is FinishReason.ABORT and call.request_id in self._migrating:
                        break  # preempted: go on elsewhere
                    if item.reason is FinishReason.ABORT and not progress.token_ids:
                        raise EngineError(f"{slot.name} aborted {call.request_id} before its first token")
                    yield item
                    self.router.mark_ok(slot)
                    return
                else:
                    raise EngineError(f"{slot.name}: the stream of {call.request_id} ended without a finish")
            except EngineError as e:
                log.warning(
                    "engine %s failed on %s after %d tokens: %s", slot.name, request_id, len(progress.token_ids), e
                )
                self.router.mark_failed(slot, str(e))
                excluded.add(slot.name)
                failures += 1
            except ValueError as e:  # the engine refused the request as invalid: the agent's fault, not retried
                raise RequestError(f"the engine rejected the request: {e}", param="prompt") from None
            finally:
                await stream.aclose()  # closing the stream early aborts the engine's request
                slot.calls.discard(call.request_id)
                self._migrating.discard(call.request_id)
                self._restarting.discard(call.request_id)
                self._progress.pop(call.request_id, None)
                self.router.release(slot)
        raise RequestError(
            f"generation failed on {self.config.max_engine_attempts} engines; try again",
            status=503,
            code="engine_unavailable",
        )

    async def _choose(self, session_id: str, excluded: set[str]) -> EngineSlot:
        """An engine for the next call; while every healthy engine is out of service (its resource trains),
        wait up to `engine_wait_s` for one to serve again."""
        deadline = time.monotonic() + self.config.engine_wait_s
        while True:
            try:
                return self.router.choose(session_id, excluded)
            except NoEngineAvailable as e:
                healthy_idle = any(not s.serving and s.up(time.monotonic()) for s in self.router.slots)
                left = deadline - time.monotonic()
                if not healthy_idle or left <= 0:
                    raise RequestError(str(e), status=503, code="engine_unavailable") from None
                self._serving_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._serving_changed.wait(), min(left, 1.0))

    async def _record(
        self, session: Session, request_id: str, prompt: tuple[int, ...], p: Progress, text: str, reason: str
    ) -> Outcome:
        ids = array("I", prompt)  # converted once for the plan, the store and the tree
        match_len, anchor = session.tree.plan(ids)
        cached = session.tree.planned_generated_prefix()  # (not the whole match: see its docstring)
        meta = {"engines": p.engines, "model": self.config.model_name}
        # arrays once, for the store's blobs and the tree alike
        generated = (array("I", p.token_ids), array("d", p.logprobs), array("i", p.versions))
        turn = NewTurn(
            session.session_id, request_id, anchor, match_len, ids[match_len:], *generated, reason, text, meta
        )
        try:
            result = await self.recorder.record(session, turn, ids)
        except StoreError as e:
            raise store_unavailable(e) from None
        session.renderer.remember(text, p.token_ids)
        return Outcome(
            session.session_id,
            request_id,
            prompt,
            tuple(p.token_ids),
            tuple(p.logprobs),
            tuple(p.versions),
            text,
            reason,
            cached,
            result.branch_id,
            tuple(p.engines),
        )
