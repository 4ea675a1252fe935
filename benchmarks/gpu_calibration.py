"""How far is the simulator's roofline from one real device? Decode, prefill and training measured with plain
torch and transformers (no vLLM) on Qwen3-architecture models with random weights, each next to what
sim/cost.py predicts for that device; the measurements are written as a profile (sim/profile.py) for
the simulator's calibrated cost model.

Models are built from their shapes in core/specs/models.yaml (qwen3-0.6b, qwen3-1.7b, qwen3-8b: nothing
is downloaded), or `tiny`, the runtime's default (reference/model.py), small enough for a CPU. Measured:
- decode: seconds per step of `batch` sequences whose KV caches hold `context` tokens each (median of
  the timed steps), against batch and context;
- prefill: seconds for one prompt of `tokens` tokens;
- train: forward + backward + AdamW of one sequence of `seq_len` tokens (loss over every position):
  tokens/s, and MFU (PaLM's model FLOPs, 6 N + 12 L d_attn s a token, over the device spec's peak);
- logprob: the trainer's forward-only pass over one sequence (no gradient; log-probs of every token):
  tokens/s and MFU of the forward's FLOPs;
- the device itself: a large square matrix product (TFLOP/s), a device-to-device copy (GB/s, bytes read
  plus written) and, on a GPU, copies between pinned host memory and the device (GB/s each way).
`--parts` picks which of decode, prefill, train and logprob to measure.

Departures, on purpose: decode and prefill run the built-in engine's forward (reference/engine/
qwen3_forward.py: a padded slot cache, sdpa attention, no CUDA graphs, paged attention or fused
kernels), a plain-torch floor of what vLLM reaches. With `--cuda-graphs` (a CUDA device) each decode
point is captured once as a CUDA graph (the step, greedy sampling on the device, the next position) and
replayed, as vLLM does for decode: the host's launch cost goes, the kernels stay plain torch's.
Training keeps weights, gradients and AdamW moments in the model's dtype (8 bytes a parameter in bf16;
the simulator's default trainer keeps fp32 master weights and moments) with no activation recompute
and no overhead per step; the predictions are made for that setup (`PREDICTION`). A point that does not
fit in memory is skipped and listed.

The prediction ("sim") is the roofline of the shipped device spec matching the CUDA device's name
(`--device-spec` picks one, or a device YAML file); on a CPU there is none unless given, and "-" is
printed. The sim/measured column is predicted seconds over measured seconds: below 1 the simulator is
optimistic.

    python -m benchmarks.gpu_calibration [--models qwen3-0.6b,qwen3-1.7b,qwen3-8b] [--device cuda]
        [--device-spec h100] [--parts decode,prefill,train,logprob] [--cuda-graphs]
        [--out FILE.yaml] [--overwrite] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from core import specs
from core.errors import UserError, unknown_name
from core.specs import DeviceSpec, ModelSpec
from reference.engine.kv_cache import KVCache
from reference.engine.qwen3_forward import Qwen3Runner
from reference.model import TINY_DEFAULTS, tiny_config
from reference.tokenizer import default_tokenizer
from sim import train_layout
from sim.config import load_config
from sim.cost import CostModel
from sim.profile import (
    MEASURED_SETUP,
    DecodePoint,
    DeviceInfo,
    LogprobPoint,
    ModelProfile,
    PrefillPoint,
    Profile,
    TrainPoint,
    write_profile,
)

TINY = "tiny"
GPU_MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b")
SEED = 0
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PARTS = ("decode", "prefill", "train", "logprob")
# The simulator's config for the predictions: one GPU an engine, and the trainer measured here (the setup
# sim/calibration.py fits a profile's points in).
PREDICTION = MEASURED_SETUP


@dataclass(frozen=True)
class Grid:
    """The points measured, and how many runs each (after `warmup` untimed ones)."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_steps: int
    prefill_tokens: tuple[int, ...]
    prefill_runs: int
    train_lens: tuple[int, ...]
    train_steps: int
    warmup: int


FULL = Grid((1, 8, 32, 128), (512, 2048, 8192), 16, (512, 2048, 8192), 3, (512, 2048, 4096), 5, 2)
QUICK = Grid((1, 2), (16, 32), 3, (16, 32), 2, (16, 32), 2, 1)
# The device's own peaks: a square matrix product of this side, a copy of this many bytes.
PEAK_SIZES = {"cuda": (8192, 2**30), "cpu": (1024, 2**26)}
QUICK_PEAK_SIZES = (256, 2**22)


@dataclass(frozen=True)
class Plan:
    """What one run measures, resolved and checked before anything is built."""

    models: tuple[ModelSpec, ...]
    device: torch.device
    device_name: str
    dtype: torch.dtype
    spec: DeviceSpec | None  # the roofline's device; None: no prediction
    grid: Grid
    out: Path
    command: str
    parts: tuple[str, ...] = PARTS
    cuda_graphs: bool = False
    peak_sizes: tuple[int, int] = QUICK_PEAK_SIZES


# ---- what to run ----


def tiny_spec() -> ModelSpec:
    """reference/model.py's default model (over the shipped tokenizer) as a spec."""
    t = TINY_DEFAULTS
    return ModelSpec(
        name=TINY,
        layers=t["num_hidden_layers"],
        hidden=t["hidden_size"],
        heads=t["num_attention_heads"],
        kv_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"],
        intermediate=t["intermediate_size"],
        vocab=default_tokenizer().vocab_size,
        tie_embeddings=t["tie_word_embeddings"],
        max_context=t["max_position_embeddings"],
        qk_norm=True,
    )


def model_choices() -> dict[str, Callable[[], ModelSpec]]:
    """`tiny` and every shipped dense Qwen3 shape (q/k norms, no biases, no experts)."""
    qwen3 = {n: m for n, m in specs.models().items() if m.qk_norm and not m.qkv_bias and not m.is_moe}
    return {TINY: tiny_spec, **{name: (lambda m=m: m) for name, m in qwen3.items()}}


def qwen3_config(spec: ModelSpec) -> Qwen3Config:
    if spec.name == TINY:
        return tiny_config(spec.vocab)
    return Qwen3Config(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        tie_word_embeddings=spec.tie_embeddings,
        max_position_embeddings=spec.max_context,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )


def torch_device(name: str) -> torch.device:
    choices = "cpu, cuda, cuda:N"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown --device {name!r}; valid choices: {choices}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise UserError(f"--device {name!r}: only CPUs and CUDA GPUs are measured; valid choices: {choices}")
    if not torch.cuda.is_available():
        raise UserError(f"--device {name!r}: torch {torch.__version__} sees no CUDA GPU here; use --device cpu")
    index, count = device.index or 0, torch.cuda.device_count()
    if index >= count:
        raise UserError(f"--device {name!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def roofline_device(arg: str | None, name: str, device: torch.device) -> DeviceSpec | None:
    """The device spec named, or the shipped one whose name is in the CUDA device's (longest first)."""
    if arg:
        try:
            return specs.device(arg)
        except UserError as e:
            raise UserError(f"--device-spec: {e}") from None
    if device.type != "cuda":
        return None
    shipped = specs.devices()
    match = next((k for k in sorted(shipped, key=len, reverse=True) if k.upper() in name.upper()), None)
    return shipped[match] if match else None


def _ints(flag: str, text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    if text is None:
        return default
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{flag} must be integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} must be integers >= 1, got {text!r}")
    return values


def make_plan(args: argparse.Namespace, argv: list[str]) -> Plan:
    device = torch_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    choices = model_choices()
    names = args.models.split(",") if args.models else list(GPU_MODELS if device.type == "cuda" else (TINY,))
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise unknown_name("--models entry", unknown[0], choices)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise unknown_name("--dtype", dtype_name, DTYPES)
    grid = QUICK if args.quick else FULL
    grid = replace(
        grid,
        batches=_ints("--batches", args.batches, grid.batches),
        contexts=_ints("--contexts", args.contexts, grid.contexts),
        prefill_tokens=_ints("--prefill-tokens", args.prefill_tokens, grid.prefill_tokens),
        train_lens=_ints("--train-lens", args.train_lens, grid.train_lens),
    )
    parts = tuple(args.parts.split(",")) if args.parts is not None else PARTS
    bad = next((p for p in parts if p not in PARTS), None)
    if bad is not None or not parts:
        raise unknown_name("--parts entry", bad or "", PARTS)
    if args.cuda_graphs and device.type != "cuda":
        raise UserError(f"--cuda-graphs needs a CUDA device, got --device {device}")
    name = device_name(device)
    spec = roofline_device(args.device_spec, name, device)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"results/gpu-calibration-{spec.name if spec else device.type}-{stamp}.yaml")
    if out.exists() and not args.overwrite:
        raise UserError(f"--out {str(out)!r} exists; pass --overwrite to replace it")
    command = shlex.join(["python", "-m", "benchmarks.gpu_calibration", *argv])
    models = tuple(choices[n]() for n in names)
    sizes = QUICK_PEAK_SIZES if args.quick else PEAK_SIZES[device.type]
    return Plan(models, device, name, DTYPES[dtype_name], spec, grid, out, command, parts, args.cuda_graphs, sizes)


# ---- measuring ----


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_bytes(device: torch.device) -> float:
    """Memory a measurement may still allocate: 90% of what the GPU has free; unchecked on a CPU."""
    return torch.cuda.mem_get_info(device)[0] * 0.9 if device.type == "cuda" else math.inf


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """Random weights (transformers' own init), created on `device` in `dtype`, from a fixed seed."""
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(SEED)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = Qwen3ForCausalLM(qwen3_config(spec))
        finally:
            torch.set_default_dtype(previous)
    return model


def _cache(spec: ModelSpec, slots: int, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    """A KV cache of exactly `slots` x `capacity` (KVCache.ensure would round both up)."""
    cache = KVCache(spec.layers, spec.kv_heads, spec.head_dim, slots, capacity, dtype, device)
    shape = (spec.layers, slots, spec.kv_heads, capacity, spec.head_dim)  # [layers, slots, kv_heads, capacity, hd]
    cache.k = torch.zeros(shape, dtype=dtype, device=device)
    cache.v = torch.zeros_like(cache.k)
    return cache


def _timed(run: Callable[[], object], device: torch.device, warmup: int, runs: int, pick=statistics.median) -> float:
    """Median (or `pick`) seconds of `runs` calls after `warmup` untimed ones."""
    times = []
    for i in range(warmup + runs):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return pick(times)


def measure_decode(runner: Qwen3Runner, spec: ModelSpec, plan: Plan, skipped: list[str]) -> list[DecodePoint]:
    g, rng, points = plan.grid, random.Random(SEED), []
    steps = g.warmup + g.decode_steps
    for batch in g.batches:
        for context in g.contexts:
            _release(plan.device)  # the last point's cache back from torch's allocator, for _free_bytes to see
            need = 2 * spec.layers * spec.kv_heads * spec.head_dim * plan.dtype.itemsize * batch * (context + steps)
            if context + steps > spec.max_context:
                skipped.append(
                    f"decode batch={batch} context={context}: {context} + {steps} steps is longer than "
                    f"the model's {spec.max_context}-token context"
                )
                continue
            if need > _free_bytes(plan.device):
                skipped.append(f"decode batch={batch} context={context}: a {need / 1e9:.1f} GB KV cache does not fit")
                continue
            tokens = [rng.randrange(spec.vocab) for _ in range(batch)]
            points.append(DecodePoint(batch, context, _decode_step_s(runner, spec, plan, context, tokens)))
    return points


def _decode_step_s(runner: Qwen3Runner, spec: ModelSpec, plan: Plan, context: int, tokens: list[int]) -> float:
    """Median seconds of a decode step of len(tokens) sequences, each holding `context` tokens at the start."""
    g, batch = plan.grid, len(tokens)
    if plan.cuda_graphs:
        return _graphed_decode_step_s(runner, spec, plan, context, tokens)
    cache = _cache(spec, batch, context + g.warmup + g.decode_steps, plan.dtype, plan.device)
    positions = iter(range(context, context + g.warmup + g.decode_steps))
    # decode() returns the logits on the CPU, as an engine's sampler needs them
    return _timed(
        lambda: runner.decode(cache, tokens, [next(positions)] * batch), plan.device, g.warmup, g.decode_steps
    )


GRAPH_WARMUP = 3  # eager runs on a side stream before the capture, as torch.cuda.graph asks


def _graphed_decode_step_s(runner: Qwen3Runner, spec: ModelSpec, plan: Plan, context: int, tokens: list[int]):
    """`_decode_step_s` with the step captured once as a CUDA graph and replayed: the forward, greedy
    sampling into the next step's input and the position's advance, all on the device (as vLLM replays
    its decode graphs). Every step attends over the cache's whole capacity, masked per position."""
    g, batch, dev = plan.grid, len(tokens), plan.device
    steps = GRAPH_WARMUP + g.warmup + g.decode_steps
    cache = _cache(spec, batch, context + steps, plan.dtype, dev)
    ids, pos = torch.tensor(tokens, device=dev), torch.full((batch,), context, device=dev)
    span = context + steps

    def step() -> None:
        logits = runner.decode_step(cache, ids, pos, span, masked=True)
        ids.copy_(logits.argmax(-1))
        pos.add_(1)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP):
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()  # recorded, not run: pos stays where the warm-up left it
    try:
        return _timed(graph.replay, dev, g.warmup, g.decode_steps)
    finally:
        del graph


def measure_prefill(runner: Qwen3Runner, spec: ModelSpec, plan: Plan, skipped: list[str]) -> list[PrefillPoint]:
    g, rng, points = plan.grid, random.Random(SEED), []
    for tokens in g.prefill_tokens:
        if tokens > spec.max_context:
            skipped.append(f"prefill tokens={tokens}: longer than the model's {spec.max_context}-token context")
            continue
        ids = [rng.randrange(spec.vocab) for _ in range(tokens)]
        cache = _cache(spec, 1, tokens, plan.dtype, plan.device)
        points.append(
            PrefillPoint(tokens, _timed(partial(runner.prefill, cache, 0, ids), plan.device, g.warmup, g.prefill_runs))
        )
    return points


def measure_logprob(model: Qwen3ForCausalLM, spec: ModelSpec, plan: Plan, skipped: list[str]) -> list[LogprobPoint]:
    """The trainer's forward-only pass: logits of one sequence, then the log-prob of each next token."""
    g, points = plan.grid, []
    generator = torch.Generator(plan.device).manual_seed(SEED)

    def forward(ids: torch.Tensor) -> None:
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])

    for seq_len in g.train_lens:
        ids = torch.randint(spec.vocab, (1, seq_len), generator=generator, device=plan.device)
        try:
            seconds = _timed(partial(forward, ids), plan.device, g.warmup, g.train_steps)
        except torch.cuda.OutOfMemoryError:
            _release(plan.device)
            skipped.append(f"logprob seq_len={seq_len}: out of memory")
            continue
        flops = train_layout.forward_flops(spec, [seq_len])
        mfu = _fraction(flops / seconds, plan, f"logprob seq_len={seq_len}", skipped)
        points.append(LogprobPoint(seq_len, seq_len / seconds, mfu))
    return points


def measure_train(model: Qwen3ForCausalLM, spec: ModelSpec, plan: Plan, skipped: list[str]) -> list[TrainPoint]:
    g, points = plan.grid, []
    generator = torch.Generator(plan.device).manual_seed(SEED)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=plan.device.type == "cuda")

    def step(ids: torch.Tensor) -> None:
        logits = model(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for seq_len in g.train_lens:
        ids = torch.randint(spec.vocab, (1, seq_len), generator=generator, device=plan.device)
        try:
            seconds = _timed(partial(step, ids), plan.device, g.warmup, g.train_steps)
        except torch.cuda.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            _release(plan.device)
            skipped.append(f"train seq_len={seq_len}: out of memory")
            continue
        points.append(TrainPoint(seq_len, seq_len / seconds, _mfu(spec, plan, seq_len, seconds, skipped)))
    return points


def _mfu(spec: ModelSpec, plan: Plan, seq_len: int, seconds: float, skipped: list[str]) -> float | None:
    flops_per_s = 3 * train_layout.forward_flops(spec, [seq_len]) / seconds
    return _fraction(flops_per_s, plan, f"train seq_len={seq_len}", skipped)


def _fraction(flops_per_s: float, plan: Plan, what: str, skipped: list[str]) -> float | None:
    """`flops_per_s` over the device spec's peak; None without a spec, or above 1 (a profile holds MFU in
    (0, 1]), with the reason in `skipped`."""
    if plan.spec is None:
        return None
    mfu = flops_per_s / (plan.spec.peak_tflops * 1e12)
    if mfu > 1:
        skipped.append(f"{what}: MFU {mfu:.2f} against {plan.spec.name}'s peak; not recorded")
        return None
    return mfu


@dataclass(frozen=True)
class Peaks:
    matmul_tflops: float
    copy_gb_s: float
    host_to_device_gb_s: float | None  # None on a CPU
    device_to_host_gb_s: float | None


def measure_peaks(plan: Plan) -> Peaks:
    """The device's own ceilings: best of several runs of a square matrix product in the plan's dtype, a
    device-to-device copy (bytes read + written, as a datasheet's bandwidth counts them) and, on a GPU,
    copies from and to pinned host memory."""
    peaks = Peaks(_matmul_tflops(plan), *_copy_gb_s(plan))
    _release(plan.device)
    return peaks


def _matmul_tflops(plan: Plan) -> float:
    side, dev = plan.peak_sizes[0], plan.device
    a = torch.randn(side, side, device=dev, dtype=plan.dtype)
    b = torch.randn(side, side, device=dev, dtype=plan.dtype)
    return 2 * side**3 / _best(lambda: a @ b, dev) / 1e12


def _copy_gb_s(plan: Plan) -> tuple[float, float | None, float | None]:
    size, dev = plan.peak_sizes[1], plan.device
    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = 2 * size / _best(lambda: dst.copy_(src), dev) / 1e9
    if dev.type != "cuda":
        return copy, None, None
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    h2d = size / _best(lambda: src.copy_(host, non_blocking=True), dev) / 1e9
    d2h = size / _best(lambda: host.copy_(src, non_blocking=True), dev) / 1e9
    return copy, h2d, d2h


def _best(run: Callable[[], object], device: torch.device) -> float:
    """The fastest of 10 calls after 2 untimed ones: a ceiling."""
    return _timed(run, device, warmup=2, runs=10, pick=min)


def measure(spec: ModelSpec, plan: Plan) -> ModelProfile:
    skipped: list[str] = []
    model = build_model(spec, plan.device, plan.dtype)
    decode = prefill = train = logprob = ()
    with torch.inference_mode():
        model.eval()
        runner = Qwen3Runner(model)
        if "decode" in plan.parts:
            decode = measure_decode(runner, spec, plan, skipped)
        if "prefill" in plan.parts:
            prefill = measure_prefill(runner, spec, plan, skipped)
        if "logprob" in plan.parts:
            logprob = measure_logprob(model, spec, plan, skipped)
    if "train" in plan.parts:
        train = measure_train(model, spec, plan, skipped)
    del model, runner
    _release(plan.device)
    return ModelProfile(spec.name, tuple(decode), tuple(prefill), tuple(train), tuple(logprob), tuple(skipped))


# ---- the simulator's side, and the table ----


class Roofline:
    """sim/cost.py's predictions for one model on one device, in the measured setup (`PREDICTION`)."""

    def __init__(self, model: ModelSpec, device: DeviceSpec) -> None:
        self.model, self.device = model, device
        self.cfg = load_config(overrides=list(PREDICTION))
        self.cost = CostModel(self.cfg, model, device)

    def decode_s(self, batch: int, context: int) -> float:
        return self.cost.decode_step_s(batch, batch * context)

    def prefill_s(self, tokens: int) -> float:
        return self.cost.prefill_s(tokens, tokens * tokens / 2)

    def train_s(self, seq_len: int) -> float:
        return train_layout.step(self.cfg, self.model, self.device, [seq_len], 1).total_s

    def mfu(self, seq_len: int, seconds: float) -> float:
        return self.mfu_of(self.model, self.device, seq_len, seconds)

    def logprob_s(self, seq_len: int) -> float:
        c = self.cfg.costs
        return train_layout.forward_s(
            self.model, self.device, seq_len, c.logprob_mfu, c.logprob_attention_mfu, c.logprob_layer_host_s
        )

    @staticmethod
    def mfu_of(model: ModelSpec, device: DeviceSpec, seq_len: int, seconds: float) -> float:
        """Model FLOPs utilisation of a training step over `seq_len` tokens that takes `seconds`."""
        return 3 * train_layout.forward_flops(model, [seq_len]) / seconds / (device.peak_tflops * 1e12)


def _cells(measured_s: float, sim_s: float | None) -> str:
    """Measured ms, predicted ms and predicted / measured."""
    if sim_s is None:
        return f"{measured_s * 1e3:12.3f} {'-':>10} {'-':>13}"
    return f"{measured_s * 1e3:12.3f} {sim_s * 1e3:10.3f} {sim_s / measured_s:13.3g}"


def _pct(value: float | None) -> str:
    return f"{value:8.1%}" if value is not None else f"{'-':>8}"


def table(entry: ModelProfile, spec: ModelSpec, plan: Plan) -> list[str]:
    """The measurements of one model, each beside the roofline's prediction."""
    roof = Roofline(spec, plan.spec) if plan.spec else None
    where = f"{plan.device_name} ({plan.device}), {str(plan.dtype).removeprefix('torch.')}"
    sim = f"the {plan.spec.name} roofline (sim/cost.py)" if plan.spec else "none (no device spec: --device-spec)"
    head = f"{'measured ms':>12} {'sim ms':>10} {'sim/measured':>13}"
    size = f"{spec.params / 1e9:.2f} B" if spec.params >= 1e8 else f"{spec.params / 1e6:.2f} M"
    lines = [f"{spec.name}: {size} parameters on {where}; sim: {sim}"]
    if "decode" in plan.parts:
        lines.append(f"  {'decode':<8} {'batch':>7} {'context':>8} {head}")
    for p in entry.decode:
        sim_s = roof.decode_s(p.batch, p.context) if roof else None
        lines.append(f"  {'':<8} {p.batch:7d} {p.context:8d} {_cells(p.step_s, sim_s)}")
    if "prefill" in plan.parts:
        lines.append(f"  {'prefill':<8} {'tokens':>7} {'':>8} {head}")
    for p in entry.prefill:
        sim_s = roof.prefill_s(p.tokens) if roof else None
        lines.append(f"  {'':<8} {p.tokens:7d} {'':>8} {_cells(p.seconds, sim_s)}")
    if "train" in plan.parts:
        lines.append(f"  {'train':<8} {'seq_len':>7} {'tokens/s':>8} {head} {'MFU':>8} {'sim MFU':>8}")
    for p in entry.train:
        sim_s = roof.train_s(p.seq_len) if roof else None
        sim_mfu = roof.mfu(p.seq_len, sim_s) if roof else None
        cells = _cells(p.seq_len / p.tokens_per_s, sim_s)
        lines.append(f"  {'':<8} {p.seq_len:7d} {p.tokens_per_s:8.0f} {cells} {_pct(p.mfu)} {_pct(sim_mfu)}")
    if "logprob" in plan.parts:
        lines.append(f"  {'logprob':<8} {'seq_len':>7} {'tokens/s':>8} {head} {'MFU':>8} {'sim MFU':>8}")
    for p in entry.logprob:
        sim_s = roof.logprob_s(p.seq_len) if roof else None
        sim_mfu = roof.cfg.costs.logprob_mfu if roof else None
        cells = _cells(p.seq_len / p.tokens_per_s, sim_s)
        lines.append(f"  {'':<8} {p.seq_len:7d} {p.tokens_per_s:8.0f} {cells} {_pct(p.mfu)} {_pct(sim_mfu)}")
    lines += [f"  skipped: {reason}" for reason in entry.skipped]
    return lines


def peak_lines(peaks: Peaks, plan: Plan) -> list[str]:
    """The measured ceilings, each beside the device spec's figure."""
    spec = plan.spec
    rows = [
        ("matrix product", f"{plan.peak_sizes[0]}^3", peaks.matmul_tflops, "TFLOP/s", spec and spec.peak_tflops),
        ("device copy", f"{plan.peak_sizes[1] >> 20} MiB", peaks.copy_gb_s, "GB/s", spec and spec.hbm_bandwidth_gb_s),
        ("host to device", "pinned", peaks.host_to_device_gb_s, "GB/s", spec and spec.pcie_gb_s),
        ("device to host", "pinned", peaks.device_to_host_gb_s, "GB/s", spec and spec.pcie_gb_s),
    ]
    lines = [f"peaks on {plan.device_name}: measured, and the share of the {spec.name if spec else '-'} spec"]
    for what, size, value, unit, datasheet in rows:
        if value is None:
            continue
        share = f"{value / datasheet:8.1%}" if datasheet else f"{'-':>8}"
        lines.append(f"  {what:<15} {size:>10} {value:10.1f} {unit:<8} {share}")
    return lines


def run(plan: Plan) -> Profile:
    peaks = measure_peaks(plan)
    print("\n".join(peak_lines(peaks, plan)), flush=True)
    entries = []
    for spec in plan.models:
        print(f"measuring {spec.name} on {plan.device_name} ({plan.device}) ...", flush=True)
        entry = measure(spec, plan)
        entries.append(entry)
        print("\n".join(table(entry, spec, plan)), flush=True)
    device = DeviceInfo(
        name=plan.device_name,
        dtype=str(plan.dtype).removeprefix("torch."),
        spec=plan.spec.name if plan.spec else None,
        torch_device=str(plan.device),
        torch=torch.__version__,
        transformers=transformers.__version__,
        decode_mode="cuda-graphs" if plan.cuda_graphs else "eager",
        matmul_tflops=round(peaks.matmul_tflops, 3),
        copy_gb_s=round(peaks.copy_gb_s, 3),
        host_to_device_gb_s=_round(peaks.host_to_device_gb_s),
        device_to_host_gb_s=_round(peaks.device_to_host_gb_s),
    )
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return Profile(1, device, tuple(entries), created=created, command=plan.command)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_calibration", description=__doc__.splitlines()[0])
    p.add_argument("--models", help=f"comma-separated (default: {','.join(GPU_MODELS)} on a GPU, {TINY} on a CPU)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when torch sees one)")
    p.add_argument("--device-spec", help="the roofline's device: a shipped name (h100, ...) or a device YAML file")
    p.add_argument("--dtype", help="bfloat16 (default on a GPU), float16 or float32 (default on a CPU)")
    p.add_argument("--out", help="the profile to write (default: results/gpu-calibration-<device>-<time>.yaml)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--quick", action="store_true", help="a few small points (a CPU, a test)")
    p.add_argument("--parts", help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    p.add_argument("--cuda-graphs", action="store_true", help="decode by replaying a captured CUDA graph a step")
    for flag in ("--batches", "--contexts", "--prefill-tokens", "--train-lens"):
        p.add_argument(flag, help="comma-separated integers, replacing the grid's")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        resolved = make_plan(args, argv)
        resolved.out.parent.mkdir(parents=True, exist_ok=True)
        profile = run(resolved)
    except UserError as e:
        print(f"gpu_calibration: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    write_profile(profile, resolved.out)
    print(f"profile: {resolved.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
