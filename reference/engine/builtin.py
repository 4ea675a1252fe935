"""The built-in inference engine: continuous batching over a slot-based KV cache, on CPU.

One worker thread owns the model. Its loop: run the commands callers posted (submit, abort, pause, weight update,
resume, stats), then one step: admit waiting requests up to `max_batch`, prefill each new one (one forward over its
context except the last token, writing its KV), then ONE batched decode step that feeds every running request its last
token and samples one new token each. Requests join and leave between steps. Callers' event loops never run the model:
tokens go back through `loop.call_soon_threadsafe` into a per-request asyncio.Queue. Because commands only run between
steps, `pause()` returning means the worker is at a token boundary. A failure inside a command or a step fails only
the requests it concerns (each stream gets an EngineError); the worker keeps serving.

The pieces: `kv_cache.KVCache` (running request i lives in slot i; slots are compacted when one retires; capacity
doubles up to `max_context`), `qwen3_forward.Qwen3Runner` (prefill and batched decode over the Hugging Face modules'
weights), `sampling.sample`, `prefix_cache.PrefixCache` (finished requests' KV, copied into a new request that shares
their prefix; emptied on every weight update) and `activity.ActivityLog` (what the engine did, as timeline intervals).

Logprobs: each TokenEvent carries the sampled token's log-probability under the distribution it was drawn from (after
temperature and top-p: vLLM's "processed_logprobs"), or the model's at T = 1 with `logprobs_mode="raw"` (`sampling`).

Stop tokens are only those in `SamplingParams.stop_token_ids` (pass the tokenizer's `stop_token_ids` for chat); the
sampled stop token is included in the output. `resume()` re-prefills every running request even when the weights did
not change (that is what the protocol asks, and what is counted).

Departures from production engines (vLLM): no paged attention (prefixes are reused by copying, not shared in place),
prefills run one request at a time, and the cache is a padded tensor per slot. The code follows the model's device,
but it has only been tested on CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import random
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from core.tags import Phase
from reference.engine.activity import ActivityLog
from reference.engine.backends import EngineSpec, check_logprobs_mode
from reference.engine.base import (
    EngineError,
    EngineStats,
    Finished,
    FinishReason,
    GenerateRequest,
    TokenEvent,
    check_request,
)
from reference.engine.kv_cache import KVCache
from reference.engine.prefix_cache import PrefixCache
from reference.engine.qwen3_forward import Qwen3Runner
from reference.engine.sampling import sample
from reference.model import copy_weights, default_model, load_checkpoint, load_weights
from reference.tokenizer import Tokenizer

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a waiting stream checks that the worker is alive
IDLE_WAIT_S = 0.05  # how long an idle worker blocks on its inbox before looking again
PREFILL_BATCH_TOKENS = 4096  # new tokens per batched prefill forward, at most (a longer context goes alone)
SWITCH_INTERVAL_S = 0.0005  # an engine process's sys.setswitchinterval (see from_spec)


@dataclass
class _Seq:
    """A request inside the worker. Invariant while running: KV holds tokens[:-1] unless needs_prefill."""

    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    tokens: list[int]
    stop: frozenset[int]
    generator: torch.Generator | None = None
    generated: int = 0
    needs_prefill: bool = True


@dataclass
class _Counters:
    tokens_generated: int = 0
    prefill_tokens: int = 0
    reprefills: int = 0
    steps: int = 0
    # Wall seconds of decode steps: forward, sampling, handing the tokens out, and for a step that follows another
    # without a prefill between, the time since that step ended (the commands drained between them and the engine's
    # server streaming the tokens out, on the same core): `decode_s / steps` is what a decode step costs the process.
    decode_s: float = 0.0


def _checked_max_context(config, max_batch: int, max_context: int | None, vocab_limit: int | None) -> int:
    """Validate the engine's arguments against the model config; the context length to use."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    max_context = max_context if max_context is not None else config.max_position_embeddings
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {max_context}")
    if vocab_limit is not None and not 1 <= vocab_limit <= config.vocab_size:
        raise ValueError(f"vocab_limit must be in [1, {config.vocab_size}], got {vocab_limit}")
    return max_context


class BuiltinEngine:
    """The embedded default `InferenceEngine` (see the module docstring); `close()` (or a `with`) stops its worker."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        *,
        max_batch: int = 32,
        max_context: int | None = None,
        seed: int = 0,
        vocab_limit: int | None = None,
        tokenizer: Tokenizer | None = None,
        command_timeout_s: float = 600.0,
        prefix_cache_mb: float = 256.0,
        logprobs_mode: str = "processed",
    ) -> None:
        """`prefix_cache_mb`: KV of finished requests kept for reuse by requests that share their prefix (an agent's
        next turn); 0 turns prefix caching off. `logprobs_mode`: "processed" or "raw" (`sampling`)."""
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)
        config = model.config
        self._runner = Qwen3Runner(model)  # refuses a model it cannot run, first
        self.max_context = _checked_max_context(config, max_batch, max_context, vocab_limit)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch, self.vocab_limit, self.command_timeout_s = max_batch, vocab_limit, command_timeout_s
        self.vocab_size = vocab_limit if vocab_limit is not None else config.vocab_size
        weight = model.model.embed_tokens.weight
        layers, kv_heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, self._runner.head_dim
        self._cache = KVCache(layers, kv_heads, head_dim, max_batch, self.max_context, weight.dtype, weight.device)
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb}")
        self._prefix = PrefixCache(int(prefix_cache_mb * 2**20))
        self._activity = ActivityLog()  # worker-owned
        self._rng = random.Random(seed)  # draws per-request seeds, in submission order
        # Worker-owned state (only the worker thread touches it, via commands).
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # running[i] lives in cache slot i
        self._version, self._paused, self._counters = 0, False, _Counters()
        self._step_end: float | None = None  # when the last step ended, while the engine has been busy since
        # Shared state.
        self._inbox: queue.Queue = queue.Queue()
        self._live: set[str] = set()  # request ids with an open stream
        self._lock = threading.Lock()
        self._error: EngineError | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="builtin-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_checkpoint(cls, path: str | Path, **kw) -> BuiltinEngine:
        """An engine over a local Qwen3 checkpoint; sampling is limited to the tokenizer's ids."""
        model, tokenizer = load_checkpoint(path)
        if tokenizer.vocab_size < model.config.vocab_size:
            kw.setdefault("vocab_limit", tokenizer.vocab_size)
        return cls(model, tokenizer=tokenizer, **kw)

    @classmethod
    def default(cls, seed: int = 0, **kw) -> BuiltinEngine:
        """An engine over the tiny random-init default model (`seed` seeds both the weights and sampling)."""
        model, tokenizer = default_model(seed)
        return cls(model, seed=seed, tokenizer=tokenizer, **kw)

    # ---- the InferenceEngine protocol (runs on the caller's event loop) ----

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | Finished]:
        self._validate(request)
        rid = request.request_id
        with self._lock:
            if rid in self._live:
                raise ValueError(f"request id {rid!r} is already running")
            self._live.add(rid)
        out: asyncio.Queue = asyncio.Queue()
        seq = _Seq(request, asyncio.get_running_loop(), out, list(request.prompt_token_ids), frozenset())
        done = False
        try:
            self._post(self._cmd_submit, seq)
            while not done:
                item = await self._next_item(out)
                if isinstance(item, BaseException):
                    raise EngineError(str(item)) from item.__cause__
                if isinstance(item, Finished):
                    done = True
                    with self._lock:
                        self._live.discard(rid)
                yield item
        finally:
            if not done:
                self._post_quietly(self._cmd_abort, rid)
            with self._lock:
                self._live.discard(rid)

    async def pause(self) -> None:
        await self._call(self._cmd_pause)

    async def update_weights(self, version: int, source: str | None = None) -> None:
        await self._call(self._cmd_update, version, None if source is None else Path(source))

    async def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """In-process hand-off: copy `state_dict` into the model and stamp later tokens `version`. Only while paused."""
        await self._call(self._cmd_load_state, state_dict, version)

    async def resume(self) -> None:
        await self._call(self._cmd_resume)

    async def abort(self, request_id: str) -> None:
        await self._call(self._cmd_abort, request_id)

    async def stats(self) -> EngineStats:
        return await self._call(self._cmd_stats)

    async def timeline(self) -> dict:
        """What the engine did so far, as timeline intervals (see reference/engine/activity.py)."""
        return await self._call(self._activity.snapshot)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker (after its current step); open streams end with EngineError."""
        self._closing = True
        self._inbox.put((lambda: None, (), None))  # wake an idle worker
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def __enter__(self) -> BuiltinEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- caller side helpers ----

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise EngineError(str(self._error)) from self._error.__cause__

    def _validate(self, request: GenerateRequest) -> None:
        self._raise_if_failed()
        check_request(request, self.vocab_size, self.max_context)

    def _post(self, fn: Callable, *args, future: concurrent.futures.Future | None = None) -> None:
        self._raise_if_failed()
        if self._closing or not self._thread.is_alive():
            raise EngineError("the built-in engine is closed")
        self._inbox.put((fn, args, future))

    def _post_quietly(self, fn: Callable, *args) -> None:
        try:
            self._post(fn, *args)
        except EngineError:
            pass

    async def _call(self, fn: Callable, *args):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(fn, *args, future=future)
        try:
            async with asyncio.timeout(self.command_timeout_s):  # not wait_for: it can swallow a cancel (3.11)
                return await asyncio.wrap_future(future)
        except TimeoutError:
            raise EngineError(f"the engine did not answer {fn.__name__} within {self.command_timeout_s} s") from None

    async def _next_item(self, out: asyncio.Queue):
        while True:
            try:
                return out.get_nowait()
            except asyncio.QueueEmpty:
                pass
            try:
                async with asyncio.timeout(POLL_S):
                    return await out.get()
            except TimeoutError:
                if not self._thread.is_alive() and out.empty():
                    self._raise_if_failed()
                    raise EngineError("the built-in engine stopped") from None

    # ---- worker thread ----

    def _work(self) -> None:
        try:
            # no_grad, not inference_mode: the cache is also written by commands (abort compacts slots).
            with torch.no_grad():
                while not self._closing:
                    if not self._busy():
                        self._activity.mark(Phase.SYNC if self._paused else Phase.IDLE, 0, self._version)
                        self._step_end = None
                    self._drain_inbox(block=not self._busy())
                    if self._busy() and not self._closing:
                        self._step()
            self._fail(EngineError("the built-in engine was closed"))
        except BaseException as err:  # noqa: BLE001 - every stream must learn that the engine died
            log.exception("built-in engine worker failed")
            error = EngineError(f"the built-in engine failed: {err!r}")
            error.__cause__ = err
            self._fail(error)

    def _busy(self) -> bool:
        return not self._paused and bool(self._running or self._waiting)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, args, future = item
            if future is None:
                self._run_quietly(fn, args)
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as err:  # noqa: BLE001 - a bad command fails its caller, not the engine
                    future.set_exception(err)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run_quietly(self, fn: Callable, args: tuple) -> None:
        """Run a command nobody waits on (submit, abort); if it fails, only the request it concerns fails."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - one bad request must not end the worker
            log.exception("built-in engine command %s failed", fn.__name__)
            for seq in args:
                if isinstance(seq, _Seq):
                    self._emit(seq, _request_error(seq, err))

    def _fail(self, error: EngineError) -> None:
        self._error = error
        for seq in [*self._running, *self._waiting]:
            self._emit(seq, error)
        self._running.clear()
        self._waiting.clear()
        self._cache.release()
        while True:
            try:
                fn, args, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                future.set_exception(error)
            elif fn == self._cmd_submit:
                self._emit(args[0], error)

    @staticmethod
    def _emit(seq: _Seq, item) -> bool:
        try:
            seq.loop.call_soon_threadsafe(seq.out.put_nowait, item)
            return True
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            return False

    def _step(self) -> None:
        """Admit, prefill, decode. A failure fails only the requests it touched (a prefill: its request;
        anything else: every running request, whose KV is then dropped); the worker goes on serving."""
        while self._waiting and len(self._running) < self.max_batch:
            self._running.append(self._waiting.popleft())
        try:
            self._activity.mark(Phase.ROLLOUT, len(self._running), self._version)
            longest = max(len(s.tokens) for s in self._running)
            self._cache.ensure(len(self._running), longest)
            prefilled = self._counters.prefill_tokens
            self._prefill_new()
            if self._running:
                since = self._step_end if prefilled == self._counters.prefill_tokens else None
                self._decode(since)
        except Exception as err:  # noqa: BLE001 - a failed step fails its requests, not the engine
            log.exception("built-in engine step failed; failing its %d requests", len(self._running))
            for seq in self._running:
                self._emit(seq, _request_error(seq, err))
            self._running.clear()
            self._cache.release()  # its contents may be half-written; the next step allocates afresh
        if not self._running and not self._waiting:
            self._cache.release()
        self._step_end = time.perf_counter()

    def _prefill_new(self) -> None:
        """Prefill every running request that needs it, in as few forwards as possible: requests with the
        same context (the samples of one prompt) compute it once and copy it; contexts of one length
        after the same reused prefix share a forward. One whose prefill fails is dropped with its error."""
        same_context: dict[tuple[int, ...], list[int]] = {}
        for slot, seq in enumerate(self._running):
            if seq.needs_prefill:
                same_context.setdefault(tuple(seq.tokens[:-1]), []).append(slot)
        if not same_context:
            return
        batches: dict[tuple[int, int], list[tuple[int, tuple[int, ...]]]] = {}  # (start, length) -> (slot, suffix)
        for context, (slot, *_) in same_context.items():
            start = self._reuse_prefix(slot, context)
            batches.setdefault((start, len(context) - start), []).append((slot, context[start:]))
        failed: dict[int, Exception] = {}
        for (start, length), jobs in batches.items():
            for chunk in _chunks(jobs, max(1, PREFILL_BATCH_TOKENS // max(1, length))):
                try:
                    self._runner.prefill_batch(self._cache, [s for s, _ in chunk], [t for _, t in chunk], start)
                except Exception:  # noqa: BLE001 - retried one by one, so only a request that fails alone fails
                    for slot, suffix in chunk:
                        try:
                            self._runner.prefill(self._cache, slot, suffix, start)
                        except Exception as err:  # noqa: BLE001 - fails this request only
                            log.exception("prefill of %s failed", self._running[slot].request.request_id)
                            failed[slot] = err
                self._counters.prefill_tokens += length * len(chunk)
        for context, (first, *copies) in same_context.items():
            for slot in copies:
                if first in failed:
                    failed[slot] = failed[first]
                else:
                    self._cache.move(first, slot, len(context))
        for slot, seq in enumerate(self._running):
            seq.needs_prefill = seq.needs_prefill and slot in failed
        for slot in sorted(failed, reverse=True):
            seq = self._running[slot]
            self._remove(slot)
            self._emit(seq, _request_error(seq, failed[slot]))

    def _reuse_prefix(self, slot: int, context: Sequence[int]) -> int:
        """Copy the longest cached prefix of `context` into `slot`; how many positions it covers."""
        hit = self._prefix.lookup(context) if self._prefix.max_bytes else None
        if hit is None:
            return 0
        start, k, v = hit
        self._cache.k[:, slot, :, :start] = k[:, :, :start]
        self._cache.v[:, slot, :, :start] = v[:, :, :start]
        return start

    def _decode(self, since: float | None) -> None:
        """One decode step; its seconds count from `since` (the previous step's end) when given."""
        start = time.perf_counter() if since is None else since
        try:
            self._decode_step()
        finally:
            self._counters.decode_s += time.perf_counter() - start

    def _decode_step(self) -> None:
        running = self._running
        logits = self._runner.decode(self._cache, [s.tokens[-1] for s in running], [len(s.tokens) - 1 for s in running])
        params = [s.request.params for s in running]
        temperatures, top_ps = [p.temperature for p in params], [p.top_p for p in params]
        tokens, logprobs = sample(
            logits, temperatures, top_ps, [s.generator for s in running], self.vocab_limit, self.logprobs_mode
        )
        self._counters.steps += 1
        self._counters.tokens_generated += len(tokens)
        self._activity.add_tokens(len(tokens))
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for seq, token, logprob in zip(running, tokens, logprobs, strict=True):
            seq.tokens.append(token)
            seq.generated += 1
            by_loop.setdefault(seq.loop, []).append((seq.out, TokenEvent(token, logprob, self._version)))
        # one wake-up of each caller's loop a step, not one a token: a thread-safe call writes to a socket
        closed = set()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                closed.add(loop)
        finished: list[tuple[int, FinishReason]] = []
        for i, seq in enumerate(running):
            reason = FinishReason.ABORT if seq.loop in closed else self._finish_reason(seq)
            if reason is not None:
                finished.append((i, reason))
        for i, reason in reversed(finished):
            self._retire(i, reason)

    def _finish_reason(self, seq: _Seq) -> FinishReason | None:
        """Why seq must finish now that its last sampled token went out, or None."""
        if seq.tokens[-1] in seq.stop:
            return FinishReason.STOP
        if seq.generated >= seq.request.params.max_tokens or len(seq.tokens) >= self.max_context:
            return FinishReason.LENGTH
        return None

    def _retire(self, slot: int, reason: FinishReason) -> None:
        """End running[slot]; the last running request moves into its slot (cache included)."""
        seq = self._running[slot]
        n = len(seq.tokens) - 1  # the KV in the slot covers every token but the last sampled one
        if self._prefix.max_bytes and not seq.needs_prefill and n > 0:
            self._prefix.put(
                seq.tokens[:n], self._cache.k[:, slot, :, :n].clone(), self._cache.v[:, slot, :, :n].clone()
            )
        self._remove(slot)
        self._emit(seq, Finished(reason))

    def _remove(self, slot: int) -> None:
        """Take running[slot] out; the last running request moves into its slot (cache included)."""
        last = self._running[-1]
        if last is not self._running[slot]:
            if not last.needs_prefill:
                self._cache.move(len(self._running) - 1, slot, len(last.tokens) - 1)
            self._running[slot] = last
        self._running.pop()

    # ---- commands (run on the worker thread, between steps) ----

    def _cmd_submit(self, seq: _Seq) -> None:
        params = seq.request.params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq.generator = torch.Generator().manual_seed(seed)
        seq.stop = frozenset(params.stop_token_ids)
        self._waiting.append(seq)

    def _cmd_abort(self, request_id: str) -> None:
        for seq in self._waiting:
            if seq.request.request_id == request_id:
                self._waiting.remove(seq)
                self._emit(seq, Finished(FinishReason.ABORT))
                return
        for slot, seq in enumerate(self._running):
            if seq.request.request_id == request_id:
                self._retire(slot, FinishReason.ABORT)
                return

    def _cmd_pause(self) -> None:
        self._paused = True
        self._activity.mark(Phase.SYNC, 0, self._version)

    def _require_paused(self, what: str) -> None:
        if not self._paused:
            raise RuntimeError(f"{what} needs a paused engine; call pause() first")

    def _cmd_update(self, version: int, source: Path | None) -> None:
        self._require_paused("update_weights")
        if source is not None:
            load_weights(self.model, source)
        self._stale_kv()  # cached KV was computed by the old weights
        self._version = version

    def _cmd_load_state(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._require_paused("load_state_dict")
        copy_weights(self.model, state_dict, origin="load_state_dict")
        self._stale_kv()
        self._version = version

    def _stale_kv(self) -> None:
        """Every KV computed so far came from the old weights: drop the prefix cache, and make sure no
        running request's KV is reused (resume() recomputes it)."""
        self._prefix.clear()
        for seq in self._running:
            seq.needs_prefill = True

    def _cmd_resume(self) -> None:
        if not self._paused:
            return
        for seq in self._running:  # partial rollout: recompute the KV of prompt + tokens so far
            seq.needs_prefill = True
            self._counters.reprefills += 1
        self._paused = False

    def _cmd_stats(self) -> EngineStats:
        c = self._counters
        extra = {
            "tokens_generated": c.tokens_generated,
            "prefill_tokens": c.prefill_tokens,
            "reprefills": c.reprefills,
            "steps": c.steps,
            "decode_s": c.decode_s,
            "max_batch": self.max_batch,
            "cache_capacity": self._cache.capacity,
            "prefix_cache_hit_tokens": self._prefix.hit_tokens,
            "prefix_cache_entries": len(self._prefix),
        }
        return EngineStats(len(self._running), len(self._waiting), self._version, self._paused, self.max_context, extra)


def from_spec(spec: EngineSpec) -> BuiltinEngine:
    """The engine an engine process serves for the "builtin" backend: `spec.model`, torch on `spec.torch_threads`."""
    if spec.torch_threads > 0:
        torch.set_num_threads(spec.torch_threads)
    # The worker thread and the process's HTTP loop share one interpreter (and one core, as the runtime places
    # them): at Python's default 5 ms, the loop holding it made 128-sequence decode steps 11.5-12.5 ms, not 7.5-8.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    kw = {"seed": spec.seed, "max_batch": spec.max_batch, "logprobs_mode": spec.logprobs_mode}
    return BuiltinEngine.default(**kw) if spec.model == "default" else BuiltinEngine.from_checkpoint(spec.model, **kw)


def _request_error(seq: _Seq, err: Exception) -> EngineError:
    error = EngineError(f"the built-in engine failed on request {seq.request.request_id!r}: {err!r}")
    error.__cause__ = err
    return error


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _put_all(items: list) -> None:
    """On a caller's loop: hand each (queue, event) of one decode step to its stream."""
    for out, event in items:
        out.put_nowait(event)
