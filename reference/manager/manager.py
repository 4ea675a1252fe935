"""The trajectory manager's core: sessions, routing, retries, partial rollout control, recording.

Each session owns a prefix tree (its trajectory), a chat renderer (which splices the session's own
completions back in as the exact ids the engine sampled) and nothing else. A request is recorded
only when it finishes: the tree gets its prompt and generated tokens, the durable store gets the
O(new tokens) delta, and only then does the agent get its answer, so whatever an agent saw
survives a manager restart.

If an engine fails mid-generation, the request continues on another engine from where it stopped
(prompt + tokens so far, as partial rollout does after a weight update); the agent only sees a
slower answer. If no engine is left, the request fails with a 503 and nothing is recorded.

Sessions live in memory while in use; idle ones beyond `max_sessions_in_memory` are dropped (least
recently used first) and rebuilt from the store when they are next used.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from reference.engine.base import (
    EngineError,
    Finished,
    FinishReason,
    GenerateRequest,
    InferenceEngine,
    SamplingParams,
    TokenEvent,
)
from reference.manager.chat import ChatRenderer, IncrementalDecoder, RequestError, Sampling, find_stop
from reference.manager.prefix_tree import PrefixTree
from reference.manager.router import EngineSlot, NoEngineAvailable, Router
from reference.manager.store import TrajectoryStore

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass(frozen=True)
class ManagerConfig:
    model_name: str = "seamlessflow-tiny"
    default_max_tokens: int = 1024  # when a request names none (further capped by the context)
    max_body_bytes: int = 8 << 20
    max_engine_attempts: int = 3  # engines tried for one request before answering 503
    affinity_slack: int = 2
    engine_cooldown_s: float = 5.0
    max_sessions_in_memory: int = 10_000  # idle sessions beyond this are dropped from memory (the store keeps them)
    admin_token: str | None = None  # when set, /admin/* needs "Authorization: Bearer <token>"

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_engine_attempts < 1:
            raise ValueError(f"max_engine_attempts must be >= 1, got {self.max_engine_attempts}")
        if self.max_sessions_in_memory < 1:
            raise ValueError(f"max_sessions_in_memory must be >= 1, got {self.max_sessions_in_memory}")


ANNOTATION_KEYS = ("reward", "branch_rewards", "task_id", "meta")


def _finite(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value!r}", param=name)
    return float(value)


def check_annotations(body) -> dict:
    """A session annotation body, validated: reward (number or null), branch_rewards ({branch id:
    number}), task_id (string), meta (object)."""
    if not isinstance(body, dict) or not body:
        raise RequestError(f"the body must be a non-empty object with some of {', '.join(ANNOTATION_KEYS)}")
    unknown = sorted(set(body) - set(ANNOTATION_KEYS))
    if unknown:
        raise RequestError(
            f"unknown annotation {unknown[0]!r}; allowed: {', '.join(ANNOTATION_KEYS)}", param=unknown[0]
        )
    out = dict(body)
    if body.get("reward") is not None:
        out["reward"] = _finite(body["reward"], "reward")
    if "branch_rewards" in body:
        rewards = body["branch_rewards"]
        if not isinstance(rewards, dict) or not all(str(k).isdigit() for k in rewards):
            raise RequestError("'branch_rewards' must map branch ids to numbers", param="branch_rewards")
        out["branch_rewards"] = {str(k): _finite(v, f"branch_rewards[{k}]") for k, v in rewards.items()}
    if "task_id" in body and not isinstance(body["task_id"], str):
        raise RequestError(f"'task_id' must be a string, got {body['task_id']!r}", param="task_id")
    if "meta" in body and not isinstance(body["meta"], dict):
        raise RequestError("'meta' must be an object", param="meta")
    return out


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
    cached_tokens: int  # prompt tokens already in the session's tree
    branch_id: int
    engines: tuple[str, ...]


@dataclass
class _Session:
    tree: PrefixTree
    renderer: ChatRenderer
    in_flight: int = 0  # requests not yet recorded durably: the session must stay in memory


@dataclass
class _Progress:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    engines: list[str]


class TrajectoryManager:
    def __init__(
        self,
        engines: dict[str, InferenceEngine],
        tokenizer,
        store: TrajectoryStore,
        config: ManagerConfig | None = None,
        max_context: int | None = None,
    ) -> None:
        self.engines, self.tok, self.store = engines, tokenizer, store
        self.config = config = config or ManagerConfig()
        self.router = Router(engines, config.affinity_slack, config.engine_cooldown_s)
        self.max_context = max_context
        self.version = 0
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._pending: list[tuple[tuple, asyncio.Future]] = []  # records waiting for the store
        self._writer: asyncio.Task | None = None
        self._stop_ids = (tokenizer.im_end_id, tokenizer.eos_token_id)

    async def start(self) -> None:
        """Learn the context length and policy version from the engines."""
        stats = await asyncio.gather(*(e.stats() for e in self.engines.values()))
        if self.max_context is None:
            self.max_context = min(s.max_context for s in stats)
        self.version = max(s.version for s in stats)

    # ---- sessions ----

    def session(self, session_id: str, create: bool = True) -> _Session | None:
        if not SESSION_ID.match(session_id):
            raise RequestError(
                f"session id {session_id[:140]!r} must be 1-128 characters of letters, digits and ._:-",
                status=400,
                param="session_id",
            )
        s = self._sessions.get(session_id)
        if s is not None:
            self._sessions.move_to_end(session_id)
        elif create or self.store.has_session(session_id):
            s = self._sessions[session_id] = self._load_session(session_id)
            self._evict()
        return s

    def _evict(self) -> None:
        """Drop the least recently used idle sessions beyond the limit; they reload from the store."""
        excess = len(self._sessions) - self.config.max_sessions_in_memory
        if excess <= 0:
            return
        idle = [sid for sid, s in self._sessions.items() if s.in_flight == 0][:excess]
        for sid in idle:
            del self._sessions[sid]

    def _load_session(self, session_id: str) -> _Session:
        renderer = ChatRenderer(self.tok)
        if not self.store.has_session(session_id):
            return _Session(PrefixTree(session_id), renderer)
        for r in self.store.records(session_id):
            renderer.remember(r.text, r.token_ids)
        return _Session(self.store.load_tree(session_id), renderer)

    def session_ids(self) -> list[str]:
        return sorted(set(self._sessions) | set(self.store.sessions()))

    def trajectory(self, session_id: str) -> dict | None:
        """The session's tree as JSON, with its annotations; each branch gets its `reward` (the branch's
        own if one was set, else the session's, else null)."""
        s = self.session(session_id, create=False)
        if s is None:
            return None
        tree = s.tree.to_json()
        notes = self.store.annotations(session_id)
        tree["annotations"] = notes
        branch_rewards = notes.get("branch_rewards", {})
        for branch in tree["branches"]:
            branch["reward"] = branch_rewards.get(str(branch["branch_id"]), notes.get("reward"))
        return tree

    async def annotate(self, session_id: str, body) -> dict:
        """Attach a reward (for the session or per branch), a task id or metadata to a session."""
        updates = check_annotations(body)
        if self.session(session_id, create=False) is None or not self.store.has_session(session_id):
            raise RequestError(f"no finished request in session {session_id!r} to annotate", status=404,
                               code="session_not_found")  # fmt: skip
        return await asyncio.to_thread(self.store.annotate, session_id, updates)

    # ---- generation ----

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise RequestError(
                f"the model {model!r} does not exist; this server serves {self.config.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
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

    async def generate(
        self, session_id: str, prompt: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[str | Outcome]:
        """Yield text pieces as tokens arrive, then the recorded `Outcome`.

        Closing the iterator early (the agent went away) aborts the engine request; nothing is
        recorded for it.
        """
        session = self.session(session_id)
        session.in_flight += 1
        try:
            async with aclosing(self._generate(session, prompt, sampling)) as items:
                async for item in items:
                    yield item
        finally:
            session.in_flight -= 1

    async def _generate(
        self, session: _Session, prompt: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[str | Outcome]:
        prompt = tuple(prompt)
        max_tokens = self.budget(len(prompt), sampling)
        request_id = f"req-{uuid.uuid4().hex[:20]}"
        decoder = IncrementalDecoder(self.tok, skip_ids=self._stop_ids)
        progress = _Progress([], [], [], [])
        held = max((len(s) for s in sampling.stop), default=1) - 1  # text withheld while a stop may be forming
        emitted, reason, text = 0, "abort", None
        incremental = sampling.stream or bool(sampling.stop)  # otherwise decode once, at the end
        session_id = session.tree.session_id
        async with aclosing(self._tokens(session_id, request_id, prompt, sampling, max_tokens, progress)) as events:
            async for event in events:
                if isinstance(event, Finished):
                    reason = str(event.reason)
                    break
                if not incremental:
                    continue
                decoder.push(event.token_id)
                if sampling.stop and (cut := find_stop(decoder.text, sampling.stop, max(0, emitted - held))) >= 0:
                    reason, text = "stop", decoder.text[:cut]
                    break
                if len(decoder.text) - held > emitted:
                    yield decoder.text[emitted : len(decoder.text) - held]
                    emitted = len(decoder.text) - held
        if text is None and not incremental:
            text = self.tok.decode([t for t in progress.token_ids if t not in self._stop_ids])
        elif text is None:
            decoder.flush()
            text = decoder.text
            if sampling.stop and (cut := find_stop(text, sampling.stop, max(0, emitted - held))) >= 0:
                reason, text = "stop", text[:cut]
        if len(text) > emitted:
            yield text[emitted:]
        yield await self._record(session, request_id, prompt, progress, text, reason)

    async def _tokens(
        self,
        session_id: str,
        request_id: str,
        prompt: tuple[int, ...],
        sampling: Sampling,
        max_tokens: int,
        progress: _Progress,
    ) -> AsyncIterator[TokenEvent | Finished]:
        """The engine's tokens for one request, continued on another engine if one fails."""
        excluded: set[str] = set()
        for attempt in range(self.config.max_engine_attempts):
            try:
                slot = self.router.choose(session_id, excluded)
            except NoEngineAvailable as e:
                raise RequestError(str(e), status=503, code="engine_unavailable") from None
            params = SamplingParams(
                max_tokens=max_tokens - len(progress.token_ids),
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                stop_token_ids=self._stop_ids,
                seed=sampling.seed,
            )
            call = GenerateRequest(f"{request_id}.{attempt}", prompt + tuple(progress.token_ids), params)
            try:
                async with aclosing(self._engine_stream(slot, call, progress)) as events:
                    async for event in events:
                        yield event
                return
            except EngineError as e:
                log.warning("engine %s failed on %s after %d tokens: %s", slot.name, request_id,
                            len(progress.token_ids), e)  # fmt: skip
                self.router.mark_failed(slot)
                excluded.add(slot.name)
        raise RequestError(
            f"generation failed on {self.config.max_engine_attempts} engines; try again",
            status=503,
            code="engine_unavailable",
        )

    async def _engine_stream(
        self, slot: EngineSlot, call: GenerateRequest, progress: _Progress
    ) -> AsyncIterator[TokenEvent | Finished]:
        self.router.acquire(slot)
        progress.engines.append(slot.name)
        stream = slot.engine.stream(call)
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    progress.token_ids.append(event.token_id)
                    progress.logprobs.append(event.logprob)
                    progress.versions.append(event.version)
                elif event.reason is FinishReason.ABORT and not progress.token_ids:
                    raise EngineError(f"{slot.name} aborted {call.request_id} before its first token")
                yield event
        except ValueError as e:
            raise RequestError(f"the engine rejected the request: {e}", param="prompt") from None
        finally:
            await stream.aclose()  # closing the stream early aborts the engine's request
            self.router.release(slot)

    async def _record(
        self, session: _Session, request_id: str, prompt: tuple[int, ...], p: _Progress, text: str, reason: str
    ) -> Outcome:
        result = session.tree.insert(prompt, p.token_ids, p.logprobs, p.versions, request_id)
        session.renderer.remember(text, p.token_ids)
        await self._persist(
            (session.tree.session_id, request_id, result.anchor_request_id, result.match_len,
             prompt[result.match_len :], p.token_ids, p.logprobs, p.versions, reason, text,
             {"engines": p.engines, "model": self.config.model_name})
        )  # fmt: skip
        return Outcome(
            session.tree.session_id, request_id, prompt, tuple(p.token_ids), tuple(p.logprobs),
            tuple(p.versions), text, reason, result.match_len, result.branch_id, tuple(p.engines),
        )  # fmt: skip

    async def _persist(self, record: tuple) -> None:
        """Write a record durably; records that finish while a write is under way are committed
        together in the next transaction (group commit), always in the order they were inserted."""
        done = asyncio.get_running_loop().create_future()
        self._pending.append((record, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_pending())
        await done

    async def _write_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self.store.append_many, [record for record, _ in batch])
                results = [None] * len(batch)
            except Exception:  # one bad record must not sink the others: retry one by one
                results = []
                for record, _ in batch:
                    try:
                        await asyncio.to_thread(self.store.append, *record)
                        results.append(None)
                    except Exception as e:
                        results.append(e)
            for (_, done), error in zip(batch, results, strict=True):
                if not done.done():
                    done.set_exception(error) if error else done.set_result(None)

    # ---- partial rollout: the control plane's hooks ----

    async def pause(self) -> None:
        await asyncio.gather(*(e.pause() for e in self.engines.values()))

    async def update_weights(self, version: int, source: str | None = None) -> None:
        await asyncio.gather(*(e.update_weights(version, source) for e in self.engines.values()))
        self.version = version

    async def resume(self) -> None:
        await asyncio.gather(*(e.resume() for e in self.engines.values()))

    async def stats(self) -> dict:
        return {
            "version": self.version,
            "max_context": self.max_context,
            "sessions_in_memory": len(self._sessions),
            "engines": self.router.stats(),
        }
