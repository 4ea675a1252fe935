"""The trajectory manager's core: sessions, admission, routing, retries, partial rollout control, recording.

Each session owns a prefix tree (its trajectory) and a chat renderer (which splices the session's own
completions back in as the exact ids the engine sampled); `sessions.py` holds them in memory within a
budget. A request is recorded only when it finishes: durably first, then in the tree (`recorder.py`),
and only then does the agent get its answer, so whatever an agent saw survives a manager restart and a
failed write leaves nothing behind (the agent gets a 503; the session goes on from what is stored).

If an engine fails mid-generation, the request continues on another engine from where it stopped
(prompt + tokens so far, as partial rollout does after a weight update); the agent only sees a
slower answer. If no engine is left, the request fails with a 503 and nothing is recorded. A request
the engine rejects as invalid is the agent's fault: a 400, never retried elsewhere.

Overload is shed, not queued into collapse: agent requests beyond an in-flight limit get a 429 with
Retry-After; the limit adapts to the event loop's lag (load.py: it falls while the loop lags more than
`max_loop_lag_s`, the manager's own CPU being the bottleneck) up to `max_in_flight_requests`. A pause
that is never resumed ends after `max_pause_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import secrets
import time
from array import array
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, contextmanager
from dataclasses import dataclass

from reference.engine.base import (
    EngineError,
    Finished,
    FinishReason,
    GenerateRequest,
    InferenceEngine,
    SamplingParams,
    TokenBatch,
    abort_all,
    stream_batches,
)
from reference.manager.annotations import check_annotations, readable
from reference.manager.chat import IncrementalDecoder, RequestError, Sampling, find_stop
from reference.manager.load import AdaptiveLimit, LoopLag
from reference.manager.recorder import Recorder
from reference.manager.router import EngineSlot, NoEngineAvailable, Router
from reference.manager.sessions import MemoryBudget, Session, SessionTable
from reference.manager.store import NewTurn, StoreError, TrajectoryStore
from reference.manager.supervisor import EngineHandle, Supervisor, SupervisorConfig

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass(frozen=True)
class ManagerConfig:
    model_name: str = "seamlessflow-tiny"
    default_max_tokens: int = 1024  # when a request names none (further capped by the context)
    max_body_bytes: int = 8 << 20
    max_engine_attempts: int = 3  # engines tried for one request before answering 503
    affinity_slack: int = 2
    engine_cooldown_s: float = 5.0  # a failed engine is skipped this long, doubling with each failure in a row
    engine_max_cooldown_s: float = 300.0
    max_sessions_in_memory: int = 10_000  # idle sessions beyond this leave memory (the store keeps them)
    max_tokens_in_memory: int = 16_000_000  # tokens all sessions in memory may hold together
    max_session_tokens_in_memory: int = 2_000_000  # an idle session holding more leaves memory
    max_in_flight_requests: int = 4096  # agent requests at once; beyond it 429 (0: no cap)
    body_timeout_s: float = 30.0  # an agent request's body must arrive within this (408 after); until it has, the
    # request holds no in-flight slot, so connections that never send theirs do not lock agents out
    max_body_bytes_in_flight: int = 64 << 20  # request bodies being read, parsed or tokenised at once (their
    # Content-Length; all connections); a body beyond it gets 429 before anything of it is read
    durable_within_s: float = 10.0  # a request whose record is not durable in the store within this gets 503 (a
    # stalled disk); the record is kept when the write completes
    idle_timeout_s: float = 75.0  # a connection with no request under way (its headers not all in) closes after
    # this (nginx's keep-alive timeout); aiohttp's default was an hour, so idle and half-sent requests piled up
    max_loop_lag_s: float = 0.1  # the in-flight limit falls while the event loop lags more than this (0: fixed)
    max_pause_s: float = 900.0  # a pause not resumed within this is resumed by the manager (0: never)
    engine_wait_s: float = 600.0  # a request waits this long for an engine while all are out of service
    admin_token: str | None = None  # when set, everything but the agents' /s/<session>/v1 calls needs it
    # Web pages: a request's Host must be a loopback name or an IP address, or one of these (a page that rebinds
    # its own name to this machine names itself); a browser's Origin must be this server's, or one of these.
    # "*" allows any.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "default_max_tokens",
            "max_engine_attempts",
            "max_sessions_in_memory",
            "max_tokens_in_memory",
            "max_session_tokens_in_memory",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.idle_timeout_s > 0 or not self.durable_within_s > 0:
            raise ValueError(
                f"idle_timeout_s and durable_within_s must be > 0, got {self.idle_timeout_s} and "
                f"{self.durable_within_s}"
            )
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if not self.body_timeout_s > 0 or self.max_body_bytes_in_flight < 1:
            raise ValueError(
                f"body_timeout_s must be > 0 and max_body_bytes_in_flight >= 1, got "
                f"{self.body_timeout_s} and {self.max_body_bytes_in_flight}"
            )
        for name in ("max_in_flight_requests", "max_pause_s", "engine_cooldown_s", "max_loop_lag_s", "engine_wait_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.admin_token is not None and not self.admin_token:
            raise ValueError("admin_token must not be empty (use None for no token)")
        for name in ("allowed_hosts", "allowed_origins"):
            values = getattr(self, name)
            if isinstance(values, str) or not all(isinstance(v, str) and v.strip() for v in values):
                raise ValueError(f"{name} must be a list of non-empty names, got {values!r}")

    def budget(self) -> MemoryBudget:
        return MemoryBudget(self.max_sessions_in_memory, self.max_tokens_in_memory, self.max_session_tokens_in_memory)


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
class _Progress:
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


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.match(session_id):
        raise RequestError(
            f"session id {session_id[:140]!r} must be 1-128 characters of letters, digits and ._:-",
            param="session_id",
            code="invalid_session_id",
        )
    return session_id


class TrajectoryManager:
    def __init__(
        self,
        engines: dict[str, InferenceEngine],
        tokenizer,
        store: TrajectoryStore,
        config: ManagerConfig | None = None,
        max_context: int | None = None,
        processes: dict[str, EngineHandle] | None = None,
        supervisor: SupervisorConfig | None = None,
    ) -> None:
        """`processes`: the engine processes this manager may restart, by engine name (see supervisor.py)."""
        self.engines, self.tok, self.store = engines, tokenizer, store
        self.config = config = config or ManagerConfig()
        self.router = Router(engines, config.affinity_slack, config.engine_cooldown_s, config.engine_max_cooldown_s)
        self.sessions = SessionTable(store, tokenizer, config.budget())
        self.recorder = Recorder(store, config.durable_within_s)
        self.max_context = max_context
        self.in_flight = 0
        self.body_bytes = 0  # request bodies being read, parsed or tokenised (max_body_bytes_in_flight)
        self.shed = 0  # requests answered 429
        # Bodies over a MiB are parsed and tokenised one at a time in a thread of their own, the rest over 64 KiB in
        # two more: neither holds the threads session reloads and the store use, nor do many huge ones share memory.
        self.body_threads = {
            "large": ThreadPoolExecutor(2, thread_name_prefix="manager-body"),
            "huge": ThreadPoolExecutor(1, thread_name_prefix="manager-huge-body"),
        }
        self.watchdog_resumes = 0
        self._watchdogs: set[asyncio.Task] = set()
        self._migrating: set[str] = set()  # engine request ids aborted by `preempt`, to continue elsewhere
        self._restarting: set[str] = set()  # engine request ids aborted to start over from their prompt
        self._progress: dict[str, _Progress] = {}  # engine request id -> its request's progress
        # Request ids: a random prefix per manager process and a counter (uuid4 per request costs a syscall).
        self._request_prefix, self._request_numbers = secrets.token_hex(6), itertools.count()
        self._serving_changed = asyncio.Event()
        self.control = asyncio.Lock()  # serialises fleet state changes (pause, weights, resume, engine syncs)
        self._stop_ids = (tokenizer.im_end_id, tokenizer.eos_token_id)
        self.supervisor = Supervisor(self, processes, supervisor)
        self.connections = 0  # open HTTP connections (the server keeps it; `health` reports the cap reached)
        self.max_connections: int | None = None  # what the open-file limit leaves (`start_manager_server`)
        self.connections_closed = 0  # idle connections closed to make room for new ones
        self.admission = AdaptiveLimit(config.max_in_flight_requests, config.max_loop_lag_s)
        self.loop_lag = LoopLag(on_sample=lambda lag: self.admission.update(lag, self.in_flight))

    async def start(self) -> None:
        """Learn the context length and policy version from the engines that answer (at least one must)."""
        stats = await asyncio.gather(*(e.stats() for e in self.engines.values()), return_exceptions=True)
        up = [s for s in stats if not isinstance(s, BaseException)]
        if not up:
            raise RuntimeError(f"no engine answered at start-up: {stats[0]}")
        if self.max_context is None:
            self.max_context = min(s.max_context for s in up)
        newest = max(s.version for s in up)
        for slot in self.router.slots:
            slot.version = newest  # an engine behind is brought to it by the supervisor
        for slot, s in zip(self.router.slots, stats, strict=True):
            if isinstance(s, BaseException):
                self.router.hold_down(slot, f"no answer at start-up: {s}")
                slot.stale = True
        await asyncio.to_thread(lambda: self.tok.max_token_chars)  # (decodes the whole vocabulary once)
        self.supervisor.start()
        self.loop_lag.start()

    async def close(self) -> None:
        for task in list(self._watchdogs):
            task.cancel()
        await self.supervisor.close()
        await self.loop_lag.close()
        await asyncio.to_thread(self.recorder.close)
        for pool in self.body_threads.values():
            pool.shutdown(wait=False, cancel_futures=True)

    # ---- admission ----

    def check_admission(self) -> None:
        """A 429 the agent should retry after a while when the in-flight cap is reached (nothing is held)."""
        if self.in_flight >= self.admission.limit:
            self._shed(
                f"the manager is at its limit of {self.admission.limit} requests in flight (event loop "
                f"{self.loop_lag.lag_s * 1e3:.0f} ms behind); retry shortly"
            )

    def hold_body(self, size: int) -> None:
        """Count `size` bytes of a request body about to be read; 429 when that would pass
        `max_body_bytes_in_flight` (a body is always let in when none is held)."""
        cap = self.config.max_body_bytes_in_flight
        if self.body_bytes and self.body_bytes + size > cap:
            self._shed(
                f"request bodies of {self.body_bytes:,} bytes are being read or tokenised, and this one of "
                f"{size:,} would pass the limit of {cap:,}; retry shortly"
            )
        self.body_bytes += size

    def release_body(self, size: int) -> None:
        self.body_bytes -= size

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Count an agent request in flight; beyond the cap, a 429 the agent should retry after a while."""
        self.check_admission()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def _shed(self, message: str) -> None:
        self.shed += 1
        raise RequestError(message, status=429, code="overloaded", headers={"Retry-After": "1"})

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise RequestError(
                f"the model {model[:200]!r} does not exist; this server serves {self.config.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def check_text_length(self, chars: int) -> None:
        """A 400 for a prompt text of `chars` characters that cannot fit the context whatever its tokens (each
        token stands for at most `Tokenizer.max_token_chars` of them), before it is tokenised: tokenising a 7 MiB
        message took seconds and a gigabyte only to learn it was too long."""
        limit, per_token = self.max_context or 0, self.tok.max_token_chars
        if chars // per_token >= limit:
            raise RequestError(
                f"the prompt's {chars:,} characters are at least {chars // per_token:,} tokens (a token is at most "
                f"{per_token} characters); this model's context is {limit} tokens",
                param="messages",
                code="context_length_exceeded",
            )

    def budget(self, prompt_len: int, sampling: Sampling) -> int:
        """max_tokens for a prompt, or a 400 if the prompt and request do not fit the context."""
        limit = self.max_context or 0
        if prompt_len >= limit:
            raise RequestError(
                f"the prompt is {prompt_len} tokens; this model's context is {limit} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        if sampling.max_tokens is None:
            return min(self.config.default_max_tokens, limit - prompt_len)
        if prompt_len + sampling.max_tokens > limit:
            raise RequestError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({sampling.max_tokens}) exceeds this model's "
                f"context of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return sampling.max_tokens

    # ---- sessions ----

    async def session(self, session_id: str, create: bool = True) -> Session | None:
        """The session (from memory or the store); with `create`, a new one for an unknown id, held in
        memory only once a request of it is accepted (`accepted`)."""
        try:
            return await self.sessions.get(check_session_id(session_id), create)
        except StoreError as e:  # rebuilding it from the store needs the journal folded, and that failed
            raise _store_unavailable(e) from None

    def accepted(self, session: Session, fresh_segments: dict | None = None, prompt_tokens: int = 0) -> _Held:
        """Hold `session` in memory for an accepted request of `prompt_tokens` (and cache the segments its prompt
        needed), until the `with` block this is used in ends: `with manager.accepted(session) as session: ...`.
        A 429 when the session's requests in flight would hold more than its budget (`SessionTable.admit_prompt`)."""
        if (why := self.sessions.admit_prompt(session, prompt_tokens)) is not None:
            self._shed(f"{why}; retry when some have finished")
        held = self.sessions.attach(session, prompt_tokens=prompt_tokens)
        if fresh_segments:
            held.renderer.commit(fresh_segments)
        return _Held(self.sessions, held, prompt_tokens)

    async def session_ids(self) -> list[str]:
        try:
            stored = await asyncio.to_thread(self.store.sessions)
        except StoreError as e:
            raise _store_unavailable(e, wrote=False) from None
        return sorted(set(self.sessions.ids()) | set(stored))

    async def trajectory(self, session_id: str) -> dict | None:
        """The session's stored tree as JSON, with its annotations and their history; each branch gets its
        `reward` (the branch's own if one was set, else the session's, else null). Built from the store in
        a worker thread, so a huge tree never stalls the event loop."""
        try:
            return await asyncio.to_thread(self._trajectory, check_session_id(session_id))
        except StoreError as e:
            raise _store_unavailable(e, wrote=False) from None

    def _trajectory(self, session_id: str) -> dict | None:
        if not self.store.has_session(session_id):
            return None
        tree = self.store.load_tree(session_id).to_json()
        notes = self.store.annotations(session_id)
        tree["annotations"] = notes
        tree["annotation_history"] = self.store.annotation_history(session_id)
        branch_rewards = notes.get("branch_rewards", {})
        for branch in tree["branches"]:
            branch["reward"] = branch_rewards.get(str(branch["branch_id"]), notes.get("reward"))
        return tree

    async def annotate(self, session_id: str, body, author: str) -> dict:
        """Attach a reward (for the session or per branch), a task id or metadata to a session; every write
        is kept in the session's annotation history with its author."""
        updates, claimed = check_annotations(body)
        check_session_id(session_id)
        try:
            stored = await asyncio.to_thread(self.store.has_session, session_id)
        except StoreError as e:
            raise _store_unavailable(e) from None
        if not stored:
            raise RequestError(
                f"no finished request in session {session_id!r} to annotate", status=404, code="session_not_found"
            )
        who = readable(f"{claimed} ({author})" if claimed else author)  # a header's or a body's bad bytes: not a 500
        try:
            return await asyncio.to_thread(self.store.annotate, session_id, updates, who)
        except StoreError as e:
            raise _store_unavailable(e) from None

    # ---- generation ----

    async def complete(self, session: Session, prompt: Sequence[int], sampling: Sampling) -> Outcome:
        """The recorded `Outcome` of one request, without text pieces (what a non-streaming answer needs).
        `session` must be held (`accepted`); cancelling aborts the engine request and records nothing."""
        if sampling.stream or sampling.stop:
            async with aclosing(self.generate(session, prompt, sampling)) as items:
                async for item in items:
                    if isinstance(item, Outcome):
                        return item
            raise RuntimeError("generation ended without an outcome")
        prompt, progress, request_id = tuple(prompt), _Progress([], [], [], [], True), self._new_request_id()
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
        progress = _Progress([], [], [], [])
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
        progress: _Progress,
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
        self, session: Session, request_id: str, prompt: tuple[int, ...], p: _Progress, text: str, reason: str
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
            raise _store_unavailable(e) from None
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

    # ---- partial rollout and placement: the control plane's hooks ----
    # Every call acts on the engines named (None: all of them). Each engine keeps its own state (serving,
    # paused, weights version), which the supervisor restores on an engine that comes back.

    @property
    def version(self) -> int:
        """The newest policy version any engine holds."""
        return max(s.version for s in self.router.slots)

    @property
    def paused(self) -> bool:
        """Every engine is paused."""
        return all(s.paused for s in self.router.slots)

    def select(self, engines: Sequence[str] | None) -> list[EngineSlot]:
        """The slots of the engines named (None: all); ValueError naming an unknown one and the choices."""
        if engines is None:
            return list(self.router.slots)
        if isinstance(engines, str) or not engines:
            raise ValueError(f"engines must be a non-empty list of engine names, got {engines!r}")
        names = {s.name for s in self.router.slots}
        if unknown := [e for e in engines if e not in names]:
            raise ValueError(f"no engine {unknown[0]!r}; engines: {', '.join(sorted(names))}")
        return [s for s in self.router.slots if s.name in set(engines)]

    async def pause(self, engines: Sequence[str] | None = None) -> None:
        """Stop generation at a token boundary on these engines, keeping every request they run."""
        slots = self.select(engines)
        async with self.control:
            now = time.monotonic()
            for s in slots:
                s.paused_since = s.paused_since or now
            await self._broadcast(lambda e: e.pause(), slots)
        if self.config.max_pause_s:
            self._watchdogs.add(asyncio.create_task(self._pause_watchdog(slots, now, self.config.max_pause_s)))

    async def update_weights(
        self, version: int, source: str | Mapping[str, str] | None = None, engines: Sequence[str] | None = None
    ):
        """Load policy `version` (from checkpoint directory `source`, or the engine's own hand-off) onto
        these engines, which must be paused; tokens they sample from now on carry `version`. `source` may
        also map each engine's name to its own directory (a copy on its node that only it reads); each
        engine keeps its source, which a restarted engine is reloaded from."""
        slots = self.select(engines)
        if isinstance(source, Mapping):
            if missing := [s.name for s in slots if not isinstance(source.get(s.name), str)]:
                raise ValueError(f"update_weights: no source directory for engines {', '.join(missing)}")
            sources = {s.name: source[s.name] for s in slots}
        else:
            sources = {s.name: source for s in slots}
        async with self.control:
            by_engine = {id(s.engine): sources[s.name] for s in slots}
            if running := [s.name for s in slots if not s.paused]:
                raise RuntimeError(
                    f"update_weights needs paused engines; {', '.join(running)} not paused (POST /admin/pause first)"
                )
            await self._broadcast(lambda e: e.update_weights(version, by_engine[id(e)]), slots)
            for s in slots:
                s.version = version
                s.weights_source = sources[s.name] if sources[s.name] is not None else s.weights_source

    async def resume(self, engines: Sequence[str] | None = None) -> None:
        """Continue generation on these engines: each unfinished request re-prefills under their weights."""
        slots = self.select(engines)
        async with self.control:
            for s in slots:
                s.paused_since = None
            await self._broadcast(lambda e: e.resume(), slots)

    def set_serving(self, engine: str, serving: bool) -> None:
        """Whether `engine` takes new requests (the requests it runs are not affected; see `preempt`)."""
        (slot,) = self.select([engine])
        slot.serving = serving
        if serving:
            self._serving_changed.set()

    async def preempt(self, engine: str, timeout_s: float = 60.0) -> int:
        """Take `engine` out of service now: it takes no new request, and each request it runs continues on
        another engine from its prompt and the tokens it has so far (partial rollout; the agent only sees a
        slower answer). Returns how many requests moved; TimeoutError if some did not leave in time."""
        (slot,) = self.select([engine])
        slot.serving = False
        moved: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while slot.calls:
            fresh = slot.calls - moved
            moved |= fresh
            self._migrating |= fresh
            await abort_all(slot.engine, sorted(fresh))
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {engine}: {len(slot.calls)} requests did not move within {timeout_s} s")
            await asyncio.sleep(0.01)
        return len(moved)

    async def restart_older_than(self, min_version: int, engines: Sequence[str] | None = None) -> int:
        """Requests on these engines holding a token older than `min_version` start over from their prompt
        (their tokens could never be trained within the staleness bound). Only requests whose text has not
        reached the agent (non-streaming) are restarted. Returns how many were."""
        restarted = []
        for slot in self.select(engines):
            for call in list(slot.calls):
                p = self._progress.get(call)
                if p is not None and p.restartable and p.versions and min(p.versions) < min_version:
                    restarted.append((slot, call))
        self._restarting |= {call for _, call in restarted}
        for slot in {slot.name: slot for slot, _ in restarted}.values():
            await abort_all(slot.engine, [call for s, call in restarted if s is slot])
        return len(restarted)

    async def _pause_watchdog(self, slots: list[EngineSlot], since: float, after_s: float) -> None:
        try:
            await asyncio.sleep(after_s)
            stuck = [s.name for s in slots if s.paused_since is not None and s.paused_since <= since]
            if stuck:
                log.error(
                    "engines %s were paused for %g s without a resume (max_pause_s); resuming them",
                    ", ".join(stuck),
                    after_s,
                )
                self.watchdog_resumes += 1
                await self.resume(stuck)
        finally:
            self._watchdogs.discard(asyncio.current_task())

    async def _broadcast(self, call, slots: list[EngineSlot]) -> None:
        """Apply a control call to each of `slots` that is up. An engine that is down, or fails the call, is
        marked stale: no request goes to it until the supervisor has brought it to its state (paused or
        not, weights version). A refusal (ValueError: a bad source) is the caller's error and is raised.
        Callers hold `control`, which the supervisor also takes to sync an engine, so an engine never joins
        halfway through a pause / update / resume."""
        now = time.monotonic()
        up = [s for s in slots if s.up(now)]
        for s in slots:
            s.stale = s.stale or s not in up
        results = await asyncio.gather(*(call(s.engine) for s in up), return_exceptions=True)
        refusals = []
        for slot, result in zip(up, results, strict=True):
            if isinstance(result, EngineError | RuntimeError):  # failed, or not in its expected state: resync it
                log.warning("engine %s failed a control call: %s", slot.name, result)
                self.router.mark_failed(slot, str(result))
                slot.stale = True
            elif isinstance(result, BaseException):
                refusals.append(result)
        if refusals:
            raise refusals[0]

    # ---- observability ----

    def health(self) -> dict:
        """{"ok", "status": ok | degraded | unhealthy, "reasons": [...]}: unhealthy when no engine is up or
        the store cannot write; degraded when some engine is down or a pause has lasted over a minute."""
        reasons, status = [], "ok"
        if (problem := self.recorder.problem()) is not None:
            reasons.append(f"store: {problem}")
            status = "unhealthy"
        engines = self.router.stats()
        down = [e for e in engines if not e["up"]]
        if len(down) == len(engines):
            reasons.append("no engine is up")
            status = "unhealthy"
        elif down and status == "ok":
            status = "degraded"
        reasons += [f"engine {e['name']} is down: {e['reason']}" for e in down]
        now = time.monotonic()
        if long := [s.name for s in self.router.slots if s.paused_since is not None and now - s.paused_since > 60]:
            reasons.append(f"engines paused for over a minute: {', '.join(long)}")
            status = "degraded" if status == "ok" else status
        saturated = []
        if self.in_flight >= self.admission.limit:
            saturated.append(f"{self.in_flight} requests in flight at a limit of {self.admission.limit}")
        if self.max_connections is not None and self.connections >= self.max_connections:
            saturated.append(f"{self.connections} connections open at a limit of {self.max_connections}")
        if saturated:  # agents get 429s or lose idle connections: the server works but sheds
            reasons.append("admission saturated: " + "; ".join(saturated))
            status = "degraded" if status == "ok" else status
        return {"ok": status != "unhealthy", "status": status, "reasons": reasons}

    async def stats(self) -> dict:
        return {
            "version": self.version,
            "max_context": self.max_context,
            "paused": self.paused,
            "in_flight": self.in_flight,
            "shed": self.shed,
            "admission_limit": self.admission.limit,
            "loop_lag_ms": round(self.loop_lag.lag_s * 1e3, 1),
            "max_loop_lag_ms": round(self.loop_lag.max_lag_s * 1e3, 1),
            "sessions_in_memory": len(self.sessions),
            "tokens_in_memory": self.sessions.tokens_held,
            "evictions": self.sessions.evictions,
            "recorded": self.recorder.committed,
            "record_failures": self.recorder.failed,
            "records_journaled": self.recorder.journaled,  # of "recorded", those the event loop journaled
            "records_unfolded": self.store.unfolded,  # journaled, not yet in SQLite (other processes see them later)
            "watchdog_resumes": self.watchdog_resumes,
            "engines": self.router.stats(),
        }


class _Held:
    """The context manager of `TrajectoryManager.accepted` (a class: it runs on every request)."""

    __slots__ = ("table", "session", "prompt_tokens")

    def __init__(self, table: SessionTable, session: Session, prompt_tokens: int = 0) -> None:
        self.table, self.session, self.prompt_tokens = table, session, prompt_tokens

    def __enter__(self) -> Session:
        return self.session

    def __exit__(self, *exc: object) -> None:
        self.table.release(self.session, self.prompt_tokens)


def _store_unavailable(e: StoreError, wrote: bool = True) -> RequestError:
    then = "nothing was recorded, retry later" if wrote else "retry later"
    return RequestError(f"{e}; {then}", status=503, code="store_unavailable")
