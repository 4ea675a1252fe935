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
and no overhead per step; the predictions are made for that setup (`calibration_roofline.PREDICTION`). A
point that does not fit in memory is skipped and listed.

The prediction ("sim") is the roofline of the shipped device spec matching the CUDA device's name
(`--device-spec` picks one, or a device YAML file); on a CPU there is none unless given, and "-" is
printed. The sim/measured column is predicted seconds over measured seconds: below 1 the simulator is
optimistic.

The timing and the device's peaks are reference/measure.py's (experiments/runtime_parts.py measures with them
too); the predictions and the tables are benchmarks/calibration_roofline.py's.

    python -m benchmarks.gpu_calibration [--models qwen3-0.6b,qwen3-1.7b,qwen3-8b] [--device cuda]
        [--device-spec h100] [--parts decode,prefill,train,logprob] [--cuda-graphs]
        [--out FILE.yaml] [--overwrite] [--quick] [--processes N]

`--processes N` measures everything N times, each run in a process of its own, and writes each point's median
(each run's profile kept beside it): where the host's launches bind a point (short prefills, eager passes), one
process measured it 1.5-1.7x slower than another on the same H200.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.calibration_roofline import peak_lines, table
from core import specs
from core.cli import at_least, run_main
from core.errors import UserError, unknown_name
from core.specs import DeviceSpec, ModelSpec
from reference.engine.kv_cache import KVCache
from reference.engine.qwen3_forward import Qwen3Runner
from reference.measure import free_bytes, measure_peaks, release, timed
from reference.model import TINY_DEFAULTS, tiny_config
from reference.tokenizer import default_tokenizer
from sim import train_layout
from sim.profile import (
    POINT_KINDS,
    DecodePoint,
    DeviceInfo,
    LogprobPoint,
    ModelProfile,
    PrefillPoint,
    Profile,
    TrainPoint,
    load_profile,
    measured_fields,
    median_profile,
    points_by_key,
    write_profile,
)

TINY = "tiny"
GPU_MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b")
SEED = 0
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PARTS = ("decode", "prefill", "train", "logprob")


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


def measure_decode(runner: Qwen3Runner, spec: ModelSpec, plan: Plan, skipped: list[str]) -> list[DecodePoint]:
    g, rng, points = plan.grid, random.Random(SEED), []
    steps = g.warmup + g.decode_steps
    for batch in g.batches:
        for context in g.contexts:
            release(plan.device)  # the last point's cache back from torch's allocator, for free_bytes to see
            need = 2 * spec.layers * spec.kv_heads * spec.head_dim * plan.dtype.itemsize * batch * (context + steps)
            if context + steps > spec.max_context:
                skipped.append(
                    f"decode batch={batch} context={context}: {context} + {steps} steps is longer than "
                    f"the model's {spec.max_context}-token context"
                )
                continue
            if need > free_bytes(plan.device):
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
    return timed(lambda: runner.decode(cache, tokens, [next(positions)] * batch), plan.device, g.warmup, g.decode_steps)


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
        return timed(graph.replay, dev, g.warmup, g.decode_steps)
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
            PrefillPoint(tokens, timed(partial(runner.prefill, cache, 0, ids), plan.device, g.warmup, g.prefill_runs))
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
            seconds = timed(partial(forward, ids), plan.device, g.warmup, g.train_steps)
        except torch.cuda.OutOfMemoryError:
            release(plan.device)
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
            seconds = timed(partial(step, ids), plan.device, g.warmup, g.train_steps)
        except torch.cuda.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            release(plan.device)
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
    release(plan.device)
    return ModelProfile(spec.name, tuple(decode), tuple(prefill), tuple(train), tuple(logprob), tuple(skipped))


def run(plan: Plan) -> Profile:
    peaks = measure_peaks(plan.device, plan.dtype, *plan.peak_sizes)
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
    p.add_argument(
        "--processes",
        type=at_least(1),
        default=1,
        help="measure everything this many times, each in a process of its own, and write each point's median "
        "(each run's own profile is kept beside --out as NAME-run<i>.yaml; default 1)",
    )
    for flag in ("--batches", "--contexts", "--prefill-tokens", "--train-lens"):
        p.add_argument(flag, help="comma-separated integers, replacing the grid's")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return run_main(lambda: calibrate(args, argv), prog="gpu_calibration")


def calibrate(args: argparse.Namespace, argv: list[str]) -> int:
    resolved = make_plan(args, argv)
    resolved.out.parent.mkdir(parents=True, exist_ok=True)
    if args.processes > 1:
        runs = [run_path(resolved.out, i) for i in range(1, args.processes + 1)]
        if not args.overwrite and (there := next((r for r in runs if r.exists()), None)):
            raise UserError(f"{str(there)!r} (a run's own profile beside --out) exists; pass --overwrite to replace it")
        return calibrate_in_processes(args.processes, resolved, argv)
    profile = run(resolved)
    write_profile(profile, resolved.out)
    print(f"profile: {resolved.out}")
    return 0


def calibrate_in_processes(n: int, plan: Plan, argv: list[str]) -> int:
    """The same measurement `n` times, each in a fresh process (its own CUDA context, allocator and clocks), then
    each point's median (`sim.profile.median_profile`). One process's short prefills and eager passes, which the
    host's launches bind, measured 1.5-1.7x apart between runs on one H200; the median of several is the point."""
    own = _without(argv, ("--processes", "--out"), ("--overwrite",))
    runs = []
    for i in range(1, n + 1):
        out = run_path(plan.out, i)
        print(f"run {i} of {n}: {out}", flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_calibration", *own, "--out", str(out), "--overwrite"]
        )
        if done.returncode:
            raise UserError(f"run {i} of {n} failed (exit code {done.returncode}); its output is above")
        runs.append(load_profile(out))
    merged = median_profile(runs, command=plan.command)
    write_profile(merged, plan.out)
    print("\n".join(spread_lines(runs, merged)))
    print(f"profile: {plan.out} (each point the median of {n} runs)")
    return 0


def run_path(out: Path, i: int) -> Path:
    """Where run `i` of `--processes` keeps its own profile: beside `out`, as NAME-run<i>.yaml."""
    return out.with_name(f"{out.stem}-run{i}{out.suffix}")


def _without(argv: list[str], with_value: tuple[str, ...], alone: tuple[str, ...]) -> list[str]:
    """`argv` less the flags `with_value` (and their values, as `--flag V` or `--flag=V`) and the flags `alone`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in with_value:
            skip = True
        elif arg in alone or arg.split("=", 1)[0] in with_value:
            continue
        else:
            out.append(arg)
    return out


def spread_lines(runs: list[Profile], merged: Profile) -> list[str]:
    """Per model and kind of point: how far the runs lay apart (the largest of a point's highest over its lowest)."""
    lines = ["spread between runs (a point's highest measurement over its lowest; the largest of each kind):"]
    for m, entry in enumerate(merged.models):
        parts = []
        for kind, (_, keys) in POINT_KINDS.items():
            if not getattr(entry, kind):
                continue
            value = measured_fields(kind)[0]
            worst, where = 1.0, ""
            for key, group in points_by_key([run.models[m] for run in runs], kind).items():
                seen = [getattr(p, value) for p in group]
                if len(seen) > 1 and min(seen) > 0 and max(seen) / min(seen) > worst:
                    worst, where = max(seen) / min(seen), " ".join(f"{k}={v}" for k, v in zip(keys, key, strict=True))
            parts.append(f"{kind} {worst:.2f}x" + (f" ({where})" if where else ""))
        lines.append(f"  {entry.model}: " + "; ".join(parts))
    return lines


if __name__ == "__main__":
    sys.exit(main())
