"""The built-in inference engine: continuous batching over a slot-based KV cache, on CPU.

One worker thread owns the model. Its loop: run the commands callers posted (submit, abort, pause,
weight update, resume, stats), then one step: admit waiting requests up to `max_batch`, prefill each
new one (one forward over its context except the last token, writing its KV), then ONE batched decode
step that feeds every running request its last token and samples one new token each. Requests join
and leave between steps. Callers' event loops never run the model: tokens go back through
`loop.call_soon_threadsafe` into a per-request asyncio.Queue. Because commands only run between
steps, `pause()` returning means the worker is at a token boundary.

The forward pass is Qwen3's, written over the Hugging Face modules (embeddings, per-head q/k RMSNorm
before RoPE, grouped-query attention, SwiGLU MLP, tied or untied head) so it can read and write its
own cache: K/V tensors of shape [layers, slots, kv_heads, capacity, head_dim]. Running request i
lives in slot i (slots are compacted when one retires), capacity doubles up to `max_context`, and
decode attends over the first max(length) positions with a per-slot length mask.

Logprobs: each TokenEvent carries the RAW model log-probability of the sampled token (log_softmax of
the unscaled logits: temperature 1, no top-p, no vocab mask), i.e. what a trainer re-scoring the
sequence with `reference.model.score_logprobs` computes. Temperature, top-p and `vocab_limit` shape
only which token is drawn.

Stop tokens are only those in `SamplingParams.stop_token_ids` (pass the tokenizer's `stop_token_ids`
for chat); the sampled stop token is included in the output. `resume()` re-prefills every running
request even when the weights did not change (that is what the protocol asks, and what is counted).

Departures from production engines (vLLM): no paged attention or prefix caching, prefills run one
request at a time, and the cache is a padded tensor per slot. The code follows the model's device,
but it has only been tested on CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import random
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM

from reference.engine.base import (
    EngineError,
    EngineStats,
    Finished,
    FinishReason,
    GenerateRequest,
    TokenEvent,
)
from reference.model import copy_weights, default_model, load_checkpoint, load_weights
from reference.tokenizer import Tokenizer

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a waiting stream checks that the worker is alive
IDLE_WAIT_S = 0.05  # how long an idle worker blocks on its inbox before looking again


class _KVCache:
    """Keys and values of every layer and slot: k, v of shape [layers, slots, kv_heads, capacity, head_dim].
    Both the slot and the capacity dimension grow by doubling, up to `max_slots` and `max_capacity`."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, max_slots: int, max_capacity: int, dtype, device="cpu"
    ):
        self.shape = (layers, kv_heads, head_dim)
        self.max_slots, self.max_capacity, self.dtype, self.device = max_slots, max_capacity, dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[3]

    def ensure(self, slots: int, capacity: int) -> None:
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = min(self.max_slots, _grown(self.slots, slots, 4))
        new_capacity = min(self.max_capacity, _grown(self.capacity, capacity, 256))
        layers, kv_heads, head_dim = self.shape
        k = torch.zeros(layers, new_slots, kv_heads, new_capacity, head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        if self.k is not None:
            k[:, : self.slots, :, : self.capacity] = self.k
            v[:, : self.slots, :, : self.capacity] = self.v
        self.k, self.v = k, v

    def move(self, src: int, dst: int, length: int) -> None:
        if self.k is not None and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def release(self) -> None:
        self.k = self.v = None


def _grown(current: int, needed: int, floor: int) -> int:
    size = max(current, floor)
    while size < needed:
        size *= 2
    return size


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """Qwen3RMSNorm, inlined (no module call): normalise in float32, cast back, scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _linear(x: torch.Tensor, layer) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


class _Qwen3Runner:
    """Qwen3's forward pass over the model's own modules' weights, reading and writing a `_KVCache`.

    It reads the live parameters on every call (no fused copies), so a weight update needs no refresh."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        self.model, self.inner = model, model.model
        attn = model.model.layers[0].self_attn
        self.head_dim, self.group = attn.head_dim, attn.num_key_value_groups
        self.device = model.model.embed_tokens.weight.device

    def _qkv(self, attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # h: [B, T, hidden] -> q [B, heads, T, hd], k and v [B, kv_heads, T, hd]; cos, sin: [B, 1, T, hd]
        b, t, _ = h.shape
        q = _rms_norm(_linear(h, attn.q_proj).view(b, t, -1, self.head_dim), attn.q_norm).transpose(1, 2)
        k = _rms_norm(_linear(h, attn.k_proj).view(b, t, -1, self.head_dim), attn.k_norm).transpose(1, 2)
        v = _linear(h, attn.v_proj).view(b, t, -1, self.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    @staticmethod
    def _finish_layer(layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        # attended: [B, T, heads * hd]
        x = x + _linear(attended, layer.self_attn.o_proj)
        mlp = layer.mlp
        h = _rms_norm(x, layer.post_attention_layernorm)
        return x + _linear(mlp.act_fn(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor):
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x, positions)
        return x, cos.unsqueeze(1), sin.unsqueeze(1)

    def prefill(self, cache: _KVCache, slot: int, token_ids: Sequence[int]) -> None:
        """Write the KV of `token_ids` (positions 0..n-1) into `slot`; no logits are needed."""
        n = len(token_ids)
        if n == 0:
            return
        ids, positions = torch.tensor([list(token_ids)], device=self.device), torch.arange(n, device=self.device)
        x, cos, sin = self._embed(ids, positions[None])
        for i, layer in enumerate(self.inner.layers):
            q, k, v = self._qkv(layer.self_attn, _rms_norm(x, layer.input_layernorm), cos, sin)
            cache.k[i, slot, :, :n] = k[0]
            cache.v[i, slot, :, :n] = v[0]
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = self._finish_layer(layer, x, attended.transpose(1, 2).reshape(1, n, -1))

    def decode(self, cache: _KVCache, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Feed token b at position positions[b] of slot b (b < B), write its KV; logits [B, vocab] float32
        on the CPU (where the samplers' generators live)."""
        b, dev = len(token_ids), self.device
        pos = torch.tensor(list(positions), device=dev)
        x, cos, sin = self._embed(torch.tensor(list(token_ids), device=dev)[:, None], pos[:, None])
        span = max(positions) + 1
        mask = (torch.arange(span, device=dev)[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, span]
        rows = torch.arange(b, device=dev)
        for i, layer in enumerate(self.inner.layers):
            q, k, v = self._qkv(layer.self_attn, _rms_norm(x, layer.input_layernorm), cos, sin)
            cache.k[i][rows, :, pos] = k[:, :, 0]
            cache.v[i][rows, :, pos] = v[:, :, 0]
            keys, values = cache.k[i, :b, :, :span], cache.v[i, :b, :, :span]
            # GQA without expanding the cache: the `group` query heads of a KV head become its query rows.
            grouped = q.view(b, keys.shape[1], self.group, self.head_dim)  # [B, kv_heads, group, hd]
            attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
            x = self._finish_layer(layer, x, attended.reshape(b, 1, -1))
        return self.model.lm_head(_rms_norm(x, self.inner.norm))[:, -1].float().cpu()


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside the smallest high-probability set whose mass reaches top_p (per row)."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]  # the mass before it already reaches top_p
    return torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


def sample(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator],
    vocab_limit: int | None = None,
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V], and its raw (temperature-1, unfiltered) logprob.

    Temperature 0 is greedy; otherwise inverse-CDF sampling from softmax(logits / T) after top-p, with
    one uniform draw from the row's generator. Ids >= `vocab_limit` are never drawn."""
    raw = torch.log_softmax(logits, dim=-1)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    chosen = logits.argmax(dim=-1)
    rows = [i for i, t in enumerate(temperatures) if t > 0]
    if rows:
        temps = torch.tensor([temperatures[i] for i in rows], dtype=logits.dtype)
        probs = torch.softmax(logits[rows] / temps[:, None], dim=-1)
        if any(top_ps[i] < 1 for i in rows):
            probs = _top_p_filter(probs, torch.tensor([top_ps[i] for i in rows], dtype=probs.dtype))
        cdf = probs.cumsum(-1)
        u = torch.stack([torch.rand((), generator=generators[i], dtype=cdf.dtype) for i in rows])
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        chosen[rows] = picked.clamp(max=logits.shape[-1] - 1)
    return chosen.tolist(), raw.gather(-1, chosen[:, None])[:, 0].tolist()


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


class BuiltinEngine:
    """The embedded default `InferenceEngine` (see the module docstring). Use as a context manager, or
    call `close()`, to stop its worker thread."""

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
    ) -> None:
        config = model.config
        if getattr(config, "model_type", None) != "qwen3":
            raise ValueError(f"BuiltinEngine runs Qwen3 models, got model_type {getattr(config, 'model_type', None)!r}")
        if "sliding_attention" in (config.layer_types or []):
            raise ValueError("sliding-window attention layers are not supported by the built-in engine")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_context = max_context if max_context is not None else config.max_position_embeddings
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")
        if vocab_limit is not None and not 1 <= vocab_limit <= config.vocab_size:
            raise ValueError(f"vocab_limit must be in [1, {config.vocab_size}], got {vocab_limit}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch, self.vocab_limit, self.command_timeout_s = max_batch, vocab_limit, command_timeout_s
        self.vocab_size = vocab_limit if vocab_limit is not None else config.vocab_size
        attn = model.model.layers[0].self_attn
        kv_heads = config.num_key_value_heads
        weight = model.model.embed_tokens.weight
        self._cache = _KVCache(
            config.num_hidden_layers, kv_heads, attn.head_dim, max_batch, self.max_context, weight.dtype, weight.device
        )
        self._runner = _Qwen3Runner(model)
        self._rng = random.Random(seed)  # draws per-request seeds, in submission order
        # Worker-owned state (only the worker thread touches it, via commands).
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # running[i] lives in cache slot i
        self._version, self._paused, self._counters = 0, False, _Counters()
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
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError(f"request {request.request_id!r}: prompt_token_ids is empty")
        bad = [t for t in prompt if not (isinstance(t, Integral) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(
                f"request {request.request_id!r}: token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) >= self.max_context:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {len(prompt)} tokens leaves no room "
                f"in the {self.max_context}-token context"
            )

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
                fn(*args)
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as err:  # noqa: BLE001 - a bad command fails its caller, not the engine
                    future.set_exception(err)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

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
        while self._waiting and len(self._running) < self.max_batch:
            self._running.append(self._waiting.popleft())
        longest = max(len(s.tokens) for s in self._running)
        self._cache.ensure(len(self._running), longest)
        for slot, seq in enumerate(self._running):
            if seq.needs_prefill:
                self._runner.prefill(self._cache, slot, seq.tokens[:-1])
                self._counters.prefill_tokens += len(seq.tokens) - 1
                seq.needs_prefill = False
        self._decode()
        if not self._running and not self._waiting:
            self._cache.release()

    def _decode(self) -> None:
        running = self._running
        logits = self._runner.decode(self._cache, [s.tokens[-1] for s in running], [len(s.tokens) - 1 for s in running])
        params = [s.request.params for s in running]
        tokens, logprobs = sample(
            logits,
            [p.temperature for p in params],
            [p.top_p for p in params],
            [s.generator for s in running],
            self.vocab_limit,
        )
        self._counters.steps += 1
        self._counters.tokens_generated += len(tokens)
        finished: list[tuple[int, FinishReason]] = []
        for i, (seq, token, logprob) in enumerate(zip(running, tokens, logprobs, strict=True)):
            seq.tokens.append(token)
            seq.generated += 1
            if not self._emit(seq, TokenEvent(token, logprob, self._version)):
                finished.append((i, FinishReason.ABORT))
            elif token in seq.stop:
                finished.append((i, FinishReason.STOP))
            elif seq.generated >= seq.request.params.max_tokens or len(seq.tokens) >= self.max_context:
                finished.append((i, FinishReason.LENGTH))
        for i, reason in reversed(finished):
            self._retire(i, reason)

    def _retire(self, slot: int, reason: FinishReason) -> None:
        """End running[slot]; the last running request moves into its slot (cache included)."""
        seq, last = self._running[slot], self._running[-1]
        if last is not seq:
            self._cache.move(len(self._running) - 1, slot, len(last.tokens) - 1)
            self._running[slot] = last
        self._running.pop()
        self._emit(seq, Finished(reason))

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

    def _require_paused(self, what: str) -> None:
        if not self._paused:
            raise RuntimeError(f"{what} needs a paused engine; call pause() first")

    def _cmd_update(self, version: int, source: Path | None) -> None:
        self._require_paused("update_weights")
        if source is not None:
            load_weights(self.model, source)
        self._version = version

    def _cmd_load_state(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._require_paused("load_state_dict")
        copy_weights(self.model, state_dict, origin="load_state_dict")
        self._version = version

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
            "max_batch": self.max_batch,
            "cache_capacity": self._cache.capacity,
        }
        return EngineStats(len(self._running), len(self._waiting), self._version, self._paused, self.max_context, extra)
