"""The vLLM backend of the inference-engine seam: `VLLMEngine` over vLLM's V1 `AsyncLLM`.

vLLM is imported only when an engine is constructed, so this module imports without it. Partial
rollout (pause at a token boundary, load weights, re-prefill unfinished requests) has two modes:

- "keep" (vLLM whose `AsyncLLM.pause_generation` takes `mode`): `pause_generation(mode="keep",
  clear_cache=True)` freezes every request in vLLM's scheduler and preempts the running ones with their
  KV freed, so `resume_generation()` recomputes prompt + tokens so far under the new weights. A token
  is stamped with the version in force when it reaches this process; vLLM samples nothing while
  paused, so only a token still in transit when `resume()` returns could carry the wrong version.
- "resubmit" (any V1 vLLM): pause cancels each vLLM request (vLLM aborts it), keeping the tokens
  already streamed; resume submits prompt + those tokens with max_tokens reduced, feeding the same
  outer stream. Each vLLM request runs under one weight version, so stamps are exact.

Weights load in each worker through `WeightLoaderExtension` (vLLM's `worker_extension_cls`):
safetensors go through `model.load_weights`, which copies in place, then the prefix cache is reset.

vLLM facts relied on (vllm-project/vllm main, 2026, ~v0.17 dev; async_llm.py and core.py at 00080ee1):
vllm/v1/engine/async_llm.py (`generate` aborts its request when cancelled; `pause_generation(mode=
"abort"|"wait"|"keep", clear_cache=True)`, `resume_generation`, `collective_rpc`, `reset_prefix_cache`
returning False while KV blocks are held; `sleep`/`wake_up` free weights/KV for co-location and are
not used); vllm/v1/engine/core.py (`pause_scheduler`: keep sets PauseState.PAUSED_ALL, clear_cache
calls `reset_prefix_cache(reset_running_requests=True)`, which preempts running requests);
vllm/v1/engine/output_processor.py (early V1 `abort` sent no final output, so aborts here cancel the
generator instead); examples/rl/rlhf_async_new_apis.py (keep-pause, weight swap, resume);
examples/offline_inference/rlhf_utils.py (worker extension calling `model.load_weights`). The pause API
arrived in PR #28037 (Nov 2025), `mode="keep"` with RFC #32103 (Jan 2026); older vLLM gets "resubmit".
vLLM's trainer hand-off (`update_weights(WeightTransferUpdateRequest)`) is not wired in:
`update_weights(version, None)` only resets the prefix cache and relabels.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference.engine.base import (
    EngineError,
    EngineStats,
    Finished,
    FinishReason,
    GenerateRequest,
    TokenEvent,
    check_request,
)

PAUSE_MODES = ("auto", "keep", "resubmit")
GPU_EXTRA_HINT = "the vLLM backend needs the `gpu` extra (and an NVIDIA GPU): pip install -e '.[gpu]'"
_LOAD_METHOD = "seamlessflow_load_weights"  # WeightLoaderExtension's RPC, named to avoid Worker attributes
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class WeightLoaderExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); its methods run there via `collective_rpc`.

    vLLM refuses an extension attribute that the worker class already has, hence the prefixed name.
    """

    def seamlessflow_load_weights(self, checkpoint_dir: str) -> int:
        """Load every tensor of `checkpoint_dir`/*.safetensors into the running model; returns the count."""
        import torch
        from safetensors import safe_open

        files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {checkpoint_dir}")
        model = self.get_model() if hasattr(self, "get_model") else self.model_runner.model
        count = 0

        def tensors():
            nonlocal count
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        count += 1
                        yield name, handle.get_tensor(name)

        with torch.no_grad():
            model.load_weights(tensors())  # checkpoint names; vLLM fuses qkv / gate_up and shards for TP
        torch.cuda.synchronize()
        return count


@dataclass(eq=False)
class _Run:
    """One outer request: its stream's queue and the tokens streamed so far, across vLLM requests."""

    request: GenerateRequest
    limit: int  # tokens it may produce: max_tokens capped by the context
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokenEvent | Finished | Exception
    tokens: list[int] = field(default_factory=list)
    segments: int = 0  # vLLM requests submitted for it (1 + re-prefills in "resubmit" mode)
    vllm_id: str | None = None
    task: asyncio.Task | None = None  # pumps the current vLLM request into `events`
    done: bool = False
    abort_requested: bool = False


def _check_pause_mode(pause_mode: str) -> None:
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")


def _supports_keep(llm: Any) -> bool:
    pause = getattr(llm, "pause_generation", None)
    return pause is not None and "mode" in inspect.signature(pause).parameters


def _segment_seed(seed: int | None, segment: int) -> int | None:
    """A continuation gets its own seed, so it does not replay the random draws of the first request."""
    if seed is None or segment == 0:
        return seed
    return (seed * 1_000_003 + segment) % (2**63 - 1)


class VLLMEngine:
    """`InferenceEngine` on vLLM's V1 `AsyncLLM`; partial rollout as the module docstring describes."""

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        pause_mode: str = "auto",
        **engine_kwargs: Any,
    ) -> None:
        """`engine_kwargs` go to vLLM's `AsyncEngineArgs`. By default the tokenizer is skipped (only token
        ids cross this seam) and `WeightLoaderExtension` is installed; a caller passing its own
        `worker_extension_cls` loses `update_weights(source=...)` unless it inherits that class."""
        _check_pause_mode(pause_mode)
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError(GPU_EXTRA_HINT) from e
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if pause_mode == "keep" and not _supports_keep(AsyncLLM):
            raise ValueError("pause_mode='keep' needs a vLLM whose AsyncLLM.pause_generation takes `mode`")
        args: dict[str, Any] = {
            "model": model_path,
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_model_len": max_model_len,
            "seed": seed,
            "enforce_eager": enforce_eager,
            "skip_tokenizer_init": True,
            "disable_log_stats": True,
            "worker_extension_cls": f"{__name__}.{WeightLoaderExtension.__name__}",
        }
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**(args | engine_kwargs)))
        self._attach(llm, SamplingParams, _delta_kind(), pause_mode)

    def _attach(self, llm: Any, sampling_params_cls: type, delta_kind: Any, pause_mode: str) -> None:
        """Wire up a constructed `AsyncLLM` (split from `__init__` so a stand-in engine can be attached)."""
        _check_pause_mode(pause_mode)
        if pause_mode == "keep" and not _supports_keep(llm):
            raise ValueError("pause_mode='keep' needs a vLLM whose AsyncLLM.pause_generation takes `mode`")
        self._llm, self._sampling_params_cls, self._delta_kind = llm, sampling_params_cls, delta_kind
        self.pause_mode = pause_mode if pause_mode != "auto" else ("keep" if _supports_keep(llm) else "resubmit")
        model_config = llm.vllm_config.model_config
        self.vocab_size: int = model_config.get_vocab_size()
        self._model_config = model_config
        self._runs: dict[str, _Run] = {}
        self._version = 0  # the weights loaded last
        self._sampling_version = 0  # the weights the engine samples with (changes at resume)
        self._paused = False
        self._control = asyncio.Lock()  # serialises pause / update_weights / resume
        self.reprefills = 0  # unfinished requests recomputed by `resume` (partial rollout)

    @property
    def max_context(self) -> int:
        return self._model_config.max_model_len  # read late: vLLM may shrink it to fit the KV cache

    @property
    def vllm_engine(self) -> Any:
        """The underlying vLLM `AsyncLLM`."""
        return self._llm

    @property
    def _resubmit(self) -> bool:
        return self.pause_mode == "resubmit"

    def _check(self, request: GenerateRequest) -> None:
        check_request(request, self.vocab_size, self.max_context, self._runs)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | Finished]:
        self._check(request)
        limit = min(request.params.max_tokens, self.max_context - len(request.prompt_token_ids))
        run = _Run(request, limit)
        self._runs[request.request_id] = run
        try:
            if not (self._paused and self._resubmit):  # else resume() submits it
                self._start_segment(run)
            while True:
                item = await run.events.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            self._runs.pop(request.request_id, None)
            if not run.done:  # the consumer stopped early: cancelling the pump aborts the vLLM request
                run.done = run.abort_requested = True
                if run.task is not None:
                    run.task.cancel()

    def _start_segment(self, run: _Run) -> None:
        """Submit prompt + tokens so far as one vLLM request, or finish the run if nothing is left."""
        stop = run.request.params.stop_token_ids
        if run.tokens and run.tokens[-1] in stop:  # ended at a pause before vLLM reported it
            return self._finish(run, FinishReason.STOP)
        remaining = run.limit - len(run.tokens)
        if remaining <= 0:
            return self._finish(run, FinishReason.LENGTH)
        prompt = [*run.request.prompt_token_ids, *run.tokens]
        params = self._vllm_params(run.request, remaining, run.segments)
        run.vllm_id = f"{run.request.request_id}#{run.segments}"  # fresh id: vLLM may still hold the old
        run.segments += 1
        run.task = asyncio.create_task(self._pump(run, run.vllm_id, prompt, params, self._sampling_version))

    def _vllm_params(self, request: GenerateRequest, max_tokens: int, segment: int) -> Any:
        p = request.params
        kwargs: dict[str, Any] = {
            "n": 1,
            "max_tokens": max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "seed": _segment_seed(p.seed, segment),
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": True,  # the request's stop tokens are the only ones (vLLM still honours them)
            "logprobs": 0,  # the sampled token's logprob only
            "detokenize": False,
        }
        if self._delta_kind is not None:
            kwargs["output_kind"] = self._delta_kind  # each output carries only the new tokens
        return self._sampling_params_cls(**kwargs)

    async def _pump(self, run: _Run, vllm_id: str, prompt: list[int], params: Any, version: int) -> None:
        """Move one vLLM request's tokens into the run's queue, stamping each as it arrives."""
        reason: str | None = None
        seen = 0  # tokens taken so far, for cumulative outputs
        try:
            generator = self._llm.generate(
                prompt={"prompt_token_ids": prompt}, sampling_params=params, request_id=vllm_id
            )
            async for output in generator:
                completion = output.outputs[0]
                start = 0 if self._delta_kind is not None else seen
                ids, logprobs = list(completion.token_ids)[start:], completion.logprobs
                for i, token_id in enumerate(ids):
                    stamp = version if self._resubmit else self._sampling_version
                    self._emit(run, token_id, _logprob(logprobs, start + i, token_id), stamp)
                seen += len(ids)
                if output.finished:
                    reason = completion.finish_reason
        except Exception as e:  # not CancelledError: pause / abort / a closed stream end the request
            self._fail(run, e)
        finally:
            self._end_segment(run, reason)

    def _emit(self, run: _Run, token_id: int, logprob: float, version: int) -> None:
        if not run.done:
            run.tokens.append(token_id)
            run.events.put_nowait(TokenEvent(token_id, logprob, version))

    def _end_segment(self, run: _Run, reason: str | None) -> None:
        run.task = None
        if run.done:
            return
        if reason in _FINISH:
            self._finish(run, _FINISH[reason])
        elif run.abort_requested or not (self._paused and self._resubmit):
            self._finish(run, FinishReason.ABORT)
        # else: interrupted by pause(); resume() submits the continuation

    def _finish(self, run: _Run, reason: FinishReason) -> None:
        run.done = True
        run.events.put_nowait(Finished(reason))

    def _fail(self, run: _Run, error: Exception) -> None:
        if run.done:
            return
        run.done = True
        if isinstance(error, ValueError) and run.segments == 1 and not run.tokens:
            run.events.put_nowait(error)  # vLLM rejected the request itself
        else:
            run.events.put_nowait(EngineError(f"vLLM failed on request {run.vllm_id!r}: {error!r}"))

    async def pause(self) -> None:
        async with self._control:
            if self._paused:
                return
            self._paused = True
            try:
                if self._resubmit:
                    await self._interrupt_all()
                else:
                    await self._llm.pause_generation(mode="keep", clear_cache=True)
                    await asyncio.sleep(0)  # let the pumps stamp outputs that already arrived
            except Exception as e:
                self._paused = False
                raise EngineError(f"vLLM failed to pause: {e!r}") from e

    async def _interrupt_all(self) -> None:
        """Cancel every in-flight vLLM request (vLLM aborts it); the runs keep their tokens."""
        runs = [run for run in self._runs.values() if run.task is not None]
        tasks = [run.task for run in runs]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for run in runs:  # a request cancelled while being added may have reached the engine anyway
            await self._llm.abort(run.vllm_id)

    async def update_weights(self, version: int, source: str | None = None) -> None:
        async with self._control:
            if not self._paused:
                raise RuntimeError("update_weights needs a paused engine; call pause() first")
            if source is not None:
                if not Path(source).is_dir():
                    raise ValueError(f"source must be a local checkpoint directory, got {source!r}")
                try:
                    await self._llm.collective_rpc(_LOAD_METHOD, args=(str(source),))
                except Exception as e:
                    raise EngineError(f"loading weights from {source!r} failed (is {_LOAD_METHOD} installed?)") from e
            await self._reset_prefix_cache()
            self._version = version

    async def _reset_prefix_cache(self, attempts: int = 50, wait_s: float = 0.1) -> None:
        """vLLM refuses (returns False) while a request holds KV blocks; aborted ones free theirs soon."""
        for _ in range(attempts):
            try:
                ok = await self._llm.reset_prefix_cache()
            except Exception as e:
                raise EngineError(f"vLLM failed to reset its prefix cache: {e!r}") from e
            if ok is not False:  # older vLLM returns None
                return
            await asyncio.sleep(wait_s)
        raise EngineError(f"vLLM still refused to reset its prefix cache after {attempts * wait_s:.0f} s")

    async def resume(self) -> None:
        async with self._control:
            if not self._paused:
                return
            self._sampling_version = self._version
            self._paused = False
            if self._resubmit:
                for run in [r for r in self._runs.values() if not r.done and r.task is None]:
                    self.reprefills += run.segments > 0
                    self._start_segment(run)
                return
            self.reprefills += sum(1 for run in self._runs.values() if run.task is not None)
            try:
                await self._llm.resume_generation()
            except Exception as e:
                raise EngineError(f"vLLM failed to resume: {e!r}") from e

    async def abort(self, request_id: str) -> None:
        run = self._runs.get(request_id)
        if run is None or run.done:
            return
        run.abort_requested = True
        task = run.task
        if task is None:  # waiting for resume(): nothing in vLLM
            return self._finish(run, FinishReason.ABORT)
        task.cancel()  # vLLM's generate() aborts the request; _end_segment ends the stream with ABORT
        await asyncio.wait([task])

    async def stats(self) -> EngineStats:
        live = [run for run in self._runs.values() if not run.done]
        waiting = sum(1 for run in live if run.segments == 0)
        extra = {"pause_mode": self.pause_mode, "reprefills": self.reprefills}
        return EngineStats(len(live) - waiting, waiting, self._version, self._paused, self.max_context, extra)

    def shutdown(self) -> None:
        """Stop vLLM's engine processes and free the GPU."""
        for run in self._runs.values():
            if run.task is not None:
                run.task.cancel()
        self._llm.shutdown()


def _delta_kind() -> Any:
    try:
        from vllm.sampling_params import RequestOutputKind
    except ImportError:
        return None
    return getattr(RequestOutputKind, "DELTA", None)


def _logprob(logprobs: Any, index: int, token_id: int) -> float:
    """`logprobs[index]` maps token id -> vLLM `Logprob`; with logprobs=0 it holds the sampled token."""
    if logprobs is None:
        raise EngineError("vLLM returned no logprobs although SamplingParams.logprobs=0 asked for them")
    entry = logprobs[index][token_id]
    return float(getattr(entry, "logprob", entry))
