"""How fast is the GRPO trainer on CPU? Tokens per second against a plain transformers forward + backward of
the same batch, weight hand-off time, and the share of this CPU's measured matmul FLOP/s it reaches.

Two workloads: `math`, the math recipe's model (2 layers, 128 wide, 22-token vocabulary) on one step's
batch (16 prompts x 16 samples, 6 prompt + 3 generated tokens each); `tiny`, the runtime's default tiny
Qwen3 (4 layers, 256 wide, 4,096-token vocabulary) on 16 sequences of 128 prompt + 128 generated
tokens. The trainer's figure is a whole `Trainer.train_step` (advantages, collation, the GRPO loss with
entropy, backward, gradient clipping, AdamW); the baseline is `model(...)` + token-mean cross-entropy on
the generated tokens + `backward()` on the same padded tensors, nothing else. Tokens are all positions
of the batch (prompt included): both sides run the forward over all of them.

The built-in engine then samples the same batches (the prompts of a group shared, temperature 1,
every request submitted at once, in this process): its seconds per batch and the same FLOP share,
counting the forward third of the training count (2 N + 4 L d_attn s per position).

FLOPs per step follow PaLM's model-FLOPs count, 6 N + 12 L d_attn s per token (N: the matmul
parameters, lm_head included; L layers; d_attn = heads x head_dim; s: sequence length), against the
best of a few fp32 `torch.mm` runs of 1024 x 1024 matrices on the same threads.

    python -m benchmarks.train_speed [--steps 5] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from core.cli import at_least
from reference.engine.base import GenerateRequest, SamplingParams, generate
from reference.engine.builtin import BuiltinEngine
from reference.model import build_model, tiny_config
from reference.tasks.tokenizer import task_tokenizer
from reference.trainer.batch import Trajectory, collate
from reference.trainer.config import TrainerConfig
from reference.trainer.recipe import MathRecipe
from reference.trainer.trainer import Trainer


@dataclass(frozen=True)
class Workload:
    name: str
    model_config: object
    sequences: int
    prompt_tokens: int
    generated_tokens: int
    group_size: int


def workloads() -> list[Workload]:
    math = MathRecipe()
    return [
        Workload("math", math.model_config(task_tokenizer().vocab_size), math.batch_size, 6, 3, math.group_size),
        Workload("tiny", tiny_config(4096), 16, 128, 128, 4),
    ]


def make_batch(w: Workload, seed: int) -> list[Trajectory]:
    rng, vocab = random.Random(seed), w.model_config.vocab_size
    n, g = w.prompt_tokens, w.generated_tokens
    return [
        Trajectory(
            [rng.randrange(vocab) for _ in range(n + g)],
            [0] * n + [1] * g,
            [-rng.uniform(0.5, 6) for _ in range(g)],
            [0] * g,
            i // w.group_size,
            rng.random(),
        )
        for i in range(w.sequences)
    ]


def time_trainer(w: Workload, steps: int) -> float:
    """Median seconds of one train step (versions restamped so every token stays on-policy)."""
    trainer = Trainer(build_model(w.model_config), TrainerConfig(micro_batch_size=w.sequences), pad_id=0)
    batch = make_batch(w, 0)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        restamped = [
            Trajectory(
                t.token_ids, t.generated_mask, t.logprobs, (trainer.version,) * t.num_generated, t.group_id, t.reward
            )
            for t in batch
        ]
        start = time.perf_counter()
        trainer.train_step(restamped)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def time_plain(w: Workload, steps: int) -> float:
    """Median seconds of forward + cross-entropy + backward on the same tensors."""
    model = build_model(w.model_config).train()
    batch = collate(make_batch(w, 0), [0.0] * w.sequences, pad_id=0)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.input_ids[:, 1:], reduction="none")
        ((losses * batch.mask).sum() / batch.mask.sum()).backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def step_flops(w: Workload) -> float:
    c = w.model_config
    seq = w.prompt_tokens + w.generated_tokens
    per_token = 6 * matmul_params(c) + 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq
    return per_token * seq * w.sequences


def matmul_params(c) -> int:
    """N: the parameters that take part in a matmul, lm_head included (tied to the embedding, but still a
    matmul; the embedding lookup itself is not)."""
    model = build_model(c)
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    return matmul + c.vocab_size * c.hidden_size


def sample_flops(w: Workload) -> float:
    """Forward model-FLOPs of sampling the batch: 2 N + 4 L d_attn s per position of every sequence
    (the forward third of the training count; a shared prompt counts once per sample)."""
    c = w.model_config
    seq = w.prompt_tokens + w.generated_tokens
    per_token = 2 * matmul_params(c) + 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq
    return per_token * seq * w.sequences


def time_engine(w: Workload, repeats: int) -> float:
    """Median seconds for the built-in engine (in this process, no HTTP) to sample the workload's batch:
    `group_size` samples of each prompt at temperature 1, every request submitted at once."""
    model = build_model(w.model_config)
    rng, vocab = random.Random(0), w.model_config.vocab_size
    prompts = [tuple(rng.randrange(vocab) for _ in range(w.prompt_tokens)) for _ in range(w.sequences // w.group_size)]
    params = SamplingParams(max_tokens=w.generated_tokens, temperature=1.0)

    async def sample(engine: BuiltinEngine, tag: str) -> None:
        requests = [
            GenerateRequest(f"{tag}.{i}.{j}", p, params) for i, p in enumerate(prompts) for j in range(w.group_size)
        ]
        results = await asyncio.gather(*(generate(engine, r) for r in requests))
        assert all(len(r.token_ids) == w.generated_tokens for r in results)

    async def go() -> list[float]:
        times = []
        with BuiltinEngine(model, max_batch=w.sequences, seed=0, prefix_cache_mb=0) as engine:
            for k in range(repeats + 1):
                start = time.perf_counter()
                await sample(engine, str(k))
                times.append(time.perf_counter() - start)
        return times[1:]  # the first is a warm-up

    return statistics.median(asyncio.run(go()))


def matmul_flops_per_s(n: int = 1024, reps: int = 10) -> float:
    a, b = torch.randn(n, n, generator=torch.Generator().manual_seed(0)), torch.randn(n, n)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def time_handoff(w: Workload, repeats: int = 5) -> tuple[float, int]:
    """(median seconds, bytes) of publishing the model's weights as a new version."""
    trainer = Trainer(build_model(w.model_config), TrainerConfig(), pad_id=0)
    times, size = [], 0
    with tempfile.TemporaryDirectory() as root:
        for _ in range(repeats):
            result = trainer.publish(root)
            times.append(result.seconds)
            size = result.bytes
    return statistics.median(times), size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=at_least(1), default=5, help="timed steps per measurement (median reported)")
    p.add_argument("--quick", action="store_true", help="2 steps (smoke test)")
    args = p.parse_args()
    steps = 2 if args.quick else args.steps
    peak = matmul_flops_per_s()
    print(f"torch threads {torch.get_num_threads()}; fp32 matmul peak measured {peak / 1e9:.1f} GFLOP/s (1024^3)")
    header = ("workload", "tokens", "trainer tok/s", "plain tok/s", "ratio", "GFLOP/s", "of peak", "hand-off", "size")
    widths = (9, 7, 14, 12, 6, 8, 8, 9, 8)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for w in workloads():
        tokens = w.sequences * (w.prompt_tokens + w.generated_tokens)
        trainer_s, plain_s = time_trainer(w, steps), time_plain(w, steps)
        handoff_s, size = time_handoff(w)
        achieved = step_flops(w) / trainer_s
        speeds = (f"{tokens / trainer_s:.0f}", f"{tokens / plain_s:.0f}", f"{plain_s / trainer_s:.2f}")
        compute = (f"{achieved / 1e9:.1f}", f"{achieved / peak:.0%}")
        row = (w.name, f"{tokens}", *speeds, *compute, f"{handoff_s * 1e3:.1f} ms", f"{size / 2**20:.1f} MB")
        print(" ".join(f"{v:>{width}}" for v, width in zip(row, widths, strict=True)))
    print("ratio = trainer tokens/s / plain forward+backward tokens/s (1.00 = no overhead)")
    print("\nsampling the same batches with the built-in engine (in-process, every request at once):")
    header = ("workload", "sequences", "engine s", "tokens/s", "GFLOP/s", "of peak")
    widths = (9, 10, 9, 9, 8, 8)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for w in workloads():
        engine_s = time_engine(w, steps)
        achieved = sample_flops(w) / engine_s
        tokens = w.sequences * (w.prompt_tokens + w.generated_tokens)
        row = (
            w.name,
            f"{w.sequences}",
            f"{engine_s:.3f}",
            f"{tokens / engine_s:.0f}",
            f"{achieved / 1e9:.2f}",
            f"{achieved / peak:.0%}",
        )
        print(" ".join(f"{v:>{width}}" for v, width in zip(row, widths, strict=True)))
    print("tokens/s counts every position (prompt + generated) of every sample, as the trainer's column does")


if __name__ == "__main__":
    main()
