"""The vLLM backend of the inference-engine seam: `VLLMEngine` over vLLM's V1 `AsyncLLM` (vLLM 0.33).

vLLM is imported only when an engine is constructed, so this module imports without it. Partial
rollout (pause at a token boundary, load weights, re-prefill unfinished requests) has two modes:

- "keep" (the default where `AsyncLLM.pause_generation` takes `mode`): `pause_generation(mode="keep",
  clear_cache=True)` freezes every request in vLLM's scheduler and preempts the running ones with their
  KV freed, so `resume_generation()` recomputes prompt + tokens so far under the new weights. A token
  is stamped with the version in force when it reaches this process; vLLM samples nothing while
  paused, so only a token still in transit when `resume()` returns could carry the wrong version, and
  vLLM's own labels (below) count any that did.
- "resubmit": pause cancels each vLLM request (vLLM aborts it), keeping the tokens already streamed;
  resume submits prompt + those tokens with max_tokens reduced, feeding the same outer stream. Each
  vLLM request runs under one weight version, so stamps are exact.

Weights load through vLLM's own `Worker.reload_weights(weights_path=...)` (in place, layer by layer,
so quantized checkpoints work) where the worker class has it, else through `WeightLoaderExtension`
(`model.load_weights` on every *.safetensors tensor); the prefix cache is then reset and vLLM told the
new version's label (`update_weight_version(str(version))`). vLLM labels every engine step with it and
returns the spans on a request's final output (`CompletionOutput.weight_versions`); each token's
stamp is checked against them and a disagreement counted (`stats().extra["version_mismatches"]`).

What crosses from vLLM is mapped to the protocol: a request vLLM rejects (`VLLMClientError`, which is
not a `ValueError`) raises `ValueError` before any token; everything else (`EngineDeadError`,
`EngineGenerateError`, a full queue, finish reason "error") raises `EngineError`, which the manager
retries elsewhere. Seeds reach vLLM in [0, 2**63 - 1]: vLLM reads -1 as "unseeded" and keeps seeds in
an int64 array. A request without a seed gets one from the engine's seeded RNG, so a run replays.
Logprobs are vLLM's `logprobs_mode="processed_logprobs"` (the project's "processed", the default): the log-prob
of each sampled token under the distribution vLLM drew it from (after temperature and top-k/top-p; a greedy
request's at temperature 1), as the built-in engine reports and as the trainer scores at the rollouts' temperature
(`TrainerConfig.temperature`). vLLM's own default, "raw_logprobs" (the project's "raw"), is the temperature-1
model's, which at the SWE recipe's 0.7 is far from what was sampled; a run asks for it by name
(`engine.logprobs_mode: raw`) and its trainer then scores at temperature 1. The logits modes are refused. The
engine argument appeared in vLLM 0.10.0 (PR #21398), but its processed log-probs were taken before temperature and
top-k/top-p until 0.10.2 (PR #22387): an older vLLM is refused (`check_vllm_version`)
rather than run with a warning, since it would hand the trainer wrong behaviour log-probs without a sign. A greedy
request's processed log-probs are the log-softmax of its logits at temperature 1 (vLLM's public source:
`Sampler.sample` of vllm/v1/sample/sampler.py returns them before temperature for an all-greedy batch and scales a
greedy row of a mixed batch by 1; model runner V2's sampler, vllm/v1/worker/gpu/sample/sampler.py, leaves
temperature 0 unscaled).

vLLM facts relied on, read in the vLLM 0.33.0 wheel: vllm/v1/engine/async_llm.py (`generate` aborts its
request when cancelled and re-raises client errors; `pause_generation(mode=, clear_cache=)`,
`resume_generation`, `reset_prefix_cache` returning False while KV blocks are held, `collective_rpc`,
`update_weight_version`); vllm/v1/engine/core.py (the label "default" until the first
`update_weight_version`; labels change only while paused); vllm/outputs.py (`WeightVersionSpan`, on
the final output only); vllm/exceptions.py; vllm/sampling_params.py (seed -1 means None; temperature
above 2 rejected); vllm/v1/worker/gpu/sample/states.py (seeds in an int64 array);
vllm/v1/worker/gpu_worker.py (`reload_weights`); vllm/inputs/engine.py (`tokens_input`: raw dict
prompts are deprecated); vllm/v1/engine/input_processor.py (vLLM adds a random suffix to request ids
internally; outputs and `abort` use the caller's id).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reference.engine.base import (
    EngineError,
    EngineStats,
    Finished,
    FinishReason,
    GenerateRequest,
    TokenEvent,
    check_request,
)
from reference.engine.options import check_options, option

if TYPE_CHECKING:
    from reference.engine.backends import EngineSpec

log = logging.getLogger(__name__)

PAUSE_MODES = ("auto", "keep", "resubmit")
LOGPROBS_MODE = "processed_logprobs"  # of the distribution sampled from, as the built-in engine reports (sampling.py)
VLLM_LOGPROBS_MODES = {"processed": LOGPROBS_MODE, "raw": "raw_logprobs"}  # the project's mode -> vLLM's name
MIN_VLLM = (0, 10, 2)  # the first vLLM whose processed log-probs are taken after temperature and top-k/top-p
GPU_EXTRA_HINT = "the vLLM backend needs the `gpu` extra (and an NVIDIA GPU): pip install -e '.[gpu]'"
_LOAD_METHOD = "seamlessflow_load_weights"  # WeightLoaderExtension's RPC, named to avoid Worker attributes
_RELOAD_METHOD = "reload_weights"  # vLLM's Worker.reload_weights(weights_iterator, weights_path, ...)
_INITIAL_LABEL = "default"  # vLLM's weight-version label before the first update_weight_version
_SEED_SPACE = 2**63  # vLLM keeps seeds in an int64 array and reads -1 as "no seed": send [0, 2**63 - 1]
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


@dataclass(frozen=True)
class VLLMConfig:
    """The vLLM backend's options (its entry in reference/engine/backends.py)."""

    tensor_parallel: int = option(1, 1, help="GPUs per engine")

    def __post_init__(self) -> None:
        check_options(self)


def from_spec(spec: EngineSpec) -> VLLMEngine:
    """The engine an engine process serves for the "vllm" backend: the checkpoint `spec.model`, its weights in
    the backend's dtype (bf16) whatever the checkpoint's."""
    if spec.model == "default":
        raise ValueError("the vllm backend needs a local checkpoint directory: --model PATH")
    options: VLLMConfig = spec.options
    return VLLMEngine(
        spec.model,
        tensor_parallel_size=options.tensor_parallel,
        seed=spec.seed,
        dtype=spec.weights_dtype,
        logprobs_mode=spec.logprobs_mode,
    )


@dataclass(frozen=True)
class VLLMApi:
    """The vLLM names this backend uses, looked up once per engine (`vllm_api`); a stand-in supplies its own."""

    sampling_params: type  # vllm.SamplingParams
    delta_kind: Any  # RequestOutputKind.DELTA (None: cumulative outputs)
    tokens_input: Callable[[list[int]], Any]  # vllm.inputs.tokens_input: a prompt of token ids
    rejections: tuple[type[BaseException], ...] = ()  # vLLM's "bad request" errors (VLLMClientError)
    reload_weights: bool = False  # the worker class has vLLM's reload_weights (else WeightLoaderExtension)


def vllm_api(llm: Any) -> VLLMApi:
    """The names of the installed vLLM, and whether `llm`'s worker class can reload weights itself."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind
    from vllm.utils.import_utils import resolve_obj_by_qualname

    worker = resolve_obj_by_qualname(llm.vllm_config.parallel_config.worker_cls)
    reload = callable(getattr(worker, _RELOAD_METHOD, None))
    return VLLMApi(SamplingParams, RequestOutputKind.DELTA, tokens_input, (VLLMClientError,), reload)


class WeightLoaderExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); its methods run there via `collective_rpc`.
    The fallback where the worker has no `reload_weights`.

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


def engine_args(
    model_path: str,
    *,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.85,
    max_model_len: int | None = None,
    seed: int = 0,
    enforce_eager: bool = False,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs` for a `VLLMEngine`: `engine_kwargs` over these defaults, with a logprobs mode
    of log-probs (the project's "processed" or "raw", or vLLM's name for either; default processed). The tokenizer
    is skipped (only token ids cross this seam) and `WeightLoaderExtension` installed; a caller passing its own
    `worker_extension_cls` should inherit that class."""
    given = engine_kwargs.pop("logprobs_mode", "processed")
    mode = VLLM_LOGPROBS_MODES.get(given, given) if isinstance(given, str) else given
    if mode not in VLLM_LOGPROBS_MODES.values():
        names = [n for pair in VLLM_LOGPROBS_MODES.items() for n in pair]
        raise ValueError(
            f"logprobs_mode must be one of {', '.join(names)} (log-probs, which the trainer takes as behaviour "
            f"log-probs), got {given!r}"
        )
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
    return args | engine_kwargs | {"logprobs_mode": mode}


@dataclass(eq=False)
class _Run:
    """One outer request: its stream's queue and the tokens streamed so far, across vLLM requests."""

    request: GenerateRequest
    limit: int  # tokens it may produce: max_tokens capped by the context
    seed: int  # the request's seed, or one drawn from the engine's RNG
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokenEvent | Finished | Exception
    tokens: list[int] = field(default_factory=list)
    segments: int = 0  # vLLM requests submitted for it (1 + re-prefills in "resubmit" mode)
    vllm_id: str | None = None
    task: asyncio.Task | None = None  # pumps the current vLLM request into `events`
    done: bool = False
    abort_requested: bool = False


def check_vllm_version(version: str) -> None:
    """ImportError naming `version` when that vLLM predates MIN_VLLM (its "processed_logprobs" would be taken
    before temperature: not the log-probs of what was sampled)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        release = ()
    if release[:3] < MIN_VLLM:
        need = ".".join(map(str, MIN_VLLM))
        raise ImportError(
            f"the vllm backend needs vLLM >= {need} (logprobs_mode='processed_logprobs' taken after temperature "
            f"and top-p: the log-probs the trainer scores), found vLLM {version}; {GPU_EXTRA_HINT}"
        )


def _check_pause_mode(pause_mode: str) -> None:
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")


def _supports_keep(llm: Any) -> bool:
    pause = getattr(llm, "pause_generation", None)
    return pause is not None and "mode" in inspect.signature(pause).parameters


def _vllm_seed(seed: int, segment: int) -> int:
    """The seed vLLM gets, in [0, 2**63 - 1]; a continuation gets its own, so it does not replay the
    random draws of the first request."""
    if segment:
        seed = seed * 1_000_003 + segment
    return seed % _SEED_SPACE


class VLLMEngine:
    """`InferenceEngine` on vLLM's V1 `AsyncLLM`; partial rollout as the module docstring describes."""

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        pause_mode: str = "auto",
        **engine_kwargs: Any,
    ) -> None:
        """`engine_kwargs` go to vLLM's `AsyncEngineArgs` through `engine_args` (tensor_parallel_size,
        gpu_memory_utilization, max_model_len, enforce_eager, dtype, ...). `seed` seeds vLLM and the
        seeds drawn for requests that carry none."""
        _check_pause_mode(pause_mode)
        args = engine_args(model_path, seed=seed, **engine_kwargs)
        try:
            import vllm
        except ImportError as e:
            raise ImportError(GPU_EXTRA_HINT) from e
        check_vllm_version(getattr(vllm, "__version__", "0"))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if pause_mode == "keep" and not _supports_keep(AsyncLLM):
            raise ValueError("pause_mode='keep' needs a vLLM whose AsyncLLM.pause_generation takes `mode`")
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self._attach(llm, vllm_api(llm), pause_mode, seed)

    def _attach(self, llm: Any, api: VLLMApi, pause_mode: str, seed: int = 0) -> None:
        """Wire up a constructed `AsyncLLM` (split from `__init__` so a stand-in engine can be attached)."""
        _check_pause_mode(pause_mode)
        if pause_mode == "keep" and not _supports_keep(llm):
            raise ValueError("pause_mode='keep' needs a vLLM whose AsyncLLM.pause_generation takes `mode`")
        self._llm, self._api = llm, api
        self.pause_mode = pause_mode if pause_mode != "auto" else ("keep" if _supports_keep(llm) else "resubmit")
        model_config = llm.vllm_config.model_config
        self.vocab_size: int = model_config.get_vocab_size()
        self._model_config = model_config
        self._rng = random.Random(seed)  # draws per-request seeds, in submission order
        self._runs: dict[str, _Run] = {}
        self._version = 0  # the weights loaded last
        self._sampling_version = 0  # the weights the engine samples with (changes at resume)
        self._labels = {_INITIAL_LABEL: 0}  # vLLM's weight-version label -> our version
        self._paused = False
        self._control = asyncio.Lock()  # serialises pause / update_weights / resume
        self.reprefills = 0  # unfinished requests recomputed by `resume` (partial rollout)
        self.version_mismatches = 0  # tokens whose stamp disagreed with vLLM's label

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
        seed = request.params.seed
        run = _Run(request, limit, self._rng.getrandbits(63) if seed is None else seed)
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
        try:
            params = self._vllm_params(run, remaining)
        except Exception as e:  # vLLM validates SamplingParams on construction
            return self._fail(run, e)
        prompt = [*run.request.prompt_token_ids, *run.tokens]
        run.vllm_id = f"{run.request.request_id}#{run.segments}"  # fresh id: vLLM may still hold the old
        run.segments += 1
        run.task = asyncio.create_task(self._pump(run, run.vllm_id, prompt, params, self._sampling_version))

    def _vllm_params(self, run: _Run, max_tokens: int) -> Any:
        p = run.request.params
        kwargs: dict[str, Any] = {
            "n": 1,
            "max_tokens": max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "seed": _vllm_seed(run.seed, run.segments),
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": True,  # the request's stop tokens are the only ones (vLLM still honours them)
            "logprobs": 0,  # the sampled token's logprob only
            "detokenize": False,
        }
        if self._api.delta_kind is not None:
            kwargs["output_kind"] = self._api.delta_kind  # each output carries only the new tokens
        return self._api.sampling_params(**kwargs)

    async def _pump(self, run: _Run, vllm_id: str, prompt: list[int], params: Any, version: int) -> None:
        """Move one vLLM request's tokens into the run's queue, stamping each as it arrives; an output may
        carry several tokens (vLLM's stream_interval, speculative decoding)."""
        reason: str | None = None
        stamps: list[int] = []  # the version each token of this vLLM request was stamped with
        spans = None  # vLLM's weight-version labels, on the final output
        try:
            generator = self._llm.generate(
                prompt=self._api.tokens_input(prompt), sampling_params=params, request_id=vllm_id
            )
            async for output in generator:
                completion = output.outputs[0]
                start = 0 if self._api.delta_kind is not None else len(stamps)
                ids, logprobs = list(completion.token_ids)[start:], completion.logprobs
                for i, token_id in enumerate(ids):
                    stamps.append(version if self._resubmit else self._sampling_version)
                    self._emit(run, token_id, _logprob(logprobs, start + i, token_id), stamps[-1])
                if output.finished:
                    reason, spans = completion.finish_reason, getattr(completion, "weight_versions", None)
        except Exception as e:  # not CancelledError: pause / abort / a closed stream end the request
            self._fail(run, e)
        finally:
            if spans:
                self._check_labels(vllm_id, spans, stamps)
            self._end_segment(run, reason)

    def _emit(self, run: _Run, token_id: int, logprob: float, version: int) -> None:
        if not run.done:
            run.tokens.append(token_id)
            run.events.put_nowait(TokenEvent(token_id, logprob, version))

    def _check_labels(self, vllm_id: str, spans: Any, stamps: list[int]) -> None:
        """Count the tokens whose stamp disagrees with vLLM's label of the step that sampled them (exact:
        vLLM labels each engine step, and the label changes only while paused)."""
        wrong = 0
        for span in spans:
            version = self._labels.get(span.version)  # None: a label this engine never set
            wrong += sum(1 for stamp in stamps[span.start : span.end] if stamp != version)
        if wrong:
            self.version_mismatches += wrong
            log.warning("vLLM request %s: %d token(s) stamped with another version than vLLM's label", vllm_id, wrong)

    def _end_segment(self, run: _Run, reason: str | None) -> None:
        run.task = None
        if run.done:
            return
        if reason in _FINISH:
            self._finish(run, _FINISH[reason])
        elif reason not in (None, "abort"):  # "error": vLLM failed the request (e.g. a KV transfer)
            self._fail(run, EngineError(f"vLLM ended request {run.vllm_id!r} with finish reason {reason!r}"))
        elif run.abort_requested or not (self._paused and self._resubmit):
            self._finish(run, FinishReason.ABORT)
        # else: interrupted by pause(); resume() submits the continuation

    def _finish(self, run: _Run, reason: FinishReason) -> None:
        run.done = True
        run.events.put_nowait(Finished(reason))

    def _fail(self, run: _Run, error: Exception) -> None:
        """End the run with ValueError where vLLM rejected the request itself (before any token), else
        with EngineError: the manager then retries elsewhere."""
        if run.done:
            return
        run.done = True
        rejected = isinstance(error, (ValueError, *self._api.rejections)) and run.segments <= 1 and not run.tokens
        if rejected:
            failure: Exception = ValueError(f"vLLM rejected request {run.request.request_id!r}: {error}")
        elif isinstance(error, EngineError):
            failure = error
        else:
            failure = EngineError(f"vLLM failed on request {run.vllm_id!r}: {error!r}")
        if failure is not error:
            failure.__cause__ = error
        run.events.put_nowait(failure)

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
                await self._load(str(source))
            await self._reset_prefix_cache()
            await self._label(version)
            self._version = version

    @property
    def weight_loader(self) -> str:
        """The worker method that loads a checkpoint: vLLM's reload_weights, or WeightLoaderExtension's."""
        return _RELOAD_METHOD if self._api.reload_weights else _LOAD_METHOD

    async def _load(self, source: str) -> None:
        method = self.weight_loader
        args, kwargs = ((), {"weights_path": source}) if method == _RELOAD_METHOD else ((source,), None)
        try:
            await self._llm.collective_rpc(method, args=args, kwargs=kwargs)
        except Exception as e:
            raise EngineError(f"loading weights from {source!r} through {method} failed: {e!r}") from e

    async def _label(self, version: int) -> None:
        """Tell vLLM the new version's label (it changes only while paused, as here)."""
        label = str(version)
        try:
            await self._llm.update_weight_version(label)
        except Exception as e:
            raise EngineError(f"vLLM failed to take weight version {label!r}: {e!r}") from e
        self._labels[label] = version

    async def _reset_prefix_cache(self, attempts: int = 50, wait_s: float = 0.1) -> None:
        """vLLM refuses (returns False) while a request holds KV blocks; aborted ones free theirs soon."""
        for _ in range(attempts):
            try:
                ok = await self._llm.reset_prefix_cache()
            except Exception as e:
                raise EngineError(f"vLLM failed to reset its prefix cache: {e!r}") from e
            if ok is not False:
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
        extra = {
            "pause_mode": self.pause_mode,
            "reprefills": self.reprefills,
            "version_mismatches": self.version_mismatches,
            "weight_loader": self.weight_loader,
        }
        return EngineStats(len(live) - waiting, waiting, self._version, self._paused, self.max_context, extra)

    def shutdown(self) -> None:
        """Stop vLLM's engine processes and free the GPU."""
        for run in self._runs.values():
            if run.task is not None:
                run.task.cancel()
        self._llm.shutdown()


def _logprob(logprobs: Any, index: int, token_id: int) -> float:
    """`logprobs[index]` maps token id -> vLLM `Logprob`; with logprobs=0 it holds the sampled token."""
    if logprobs is None:
        raise EngineError("vLLM returned no logprobs although SamplingParams.logprobs=0 asked for them")
    entry = logprobs[index][token_id]
    return float(getattr(entry, "logprob", entry))
