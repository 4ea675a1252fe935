"""How fast is the built-in engine? Generated tokens per second at concurrency 1, 8 and 32, against plain
transformers `generate` run the usual way.

Workload: a stream of requests with mixed prompt lengths (uniform 16..256 tokens) and mixed lengths to
generate (uniform 16..256 new tokens), greedy, no stop tokens, so every request produces exactly what
it asked for. The built-in engine gets every request at once and runs at most `concurrency` of them
(continuous batching). The baseline runs static batches of `concurrency` requests, left-padded, each
batch until its longest member finishes (one request at a time for concurrency 1); only the tokens a
request asked for count as its output. Model: the tiny random-init default Qwen3 (on CPU).

    python -m benchmarks.engine_throughput [--requests 40] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass

import torch

from core.cli import at_least
from reference.engine.base import GenerateRequest, SamplingParams, generate
from reference.engine.builtin import BuiltinEngine
from reference.model import default_model

CONCURRENCY = (1, 8, 32)
WIDTHS = (11, 13, 15, 6, 9, 11)  # table columns


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_tokens: int


def make_jobs(n: int, seed: int, vocab: int, max_prompt: int, max_new: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(16, max_prompt)))
        jobs.append(Job(prompt, rng.randint(16, max_new)))
    return jobs


def run_engine(model, jobs: list[Job], concurrency: int) -> tuple[int, float]:
    """(generated tokens, wall seconds) with every job submitted at once."""

    async def go() -> int:
        with BuiltinEngine(model, max_batch=concurrency) as engine:
            reqs = [
                GenerateRequest(f"r{i}", job.prompt, SamplingParams(max_tokens=job.max_tokens, temperature=0))
                for i, job in enumerate(jobs)
            ]
            results = await asyncio.gather(*(generate(engine, r) for r in reqs))
        return sum(len(r.token_ids) for r in results)

    start = time.perf_counter()
    tokens = asyncio.run(go())
    return tokens, time.perf_counter() - start


def run_agents(model, prefix_cache_mb: float, sessions: int, turns: int, tool_tokens: int, reply: int, vocab: int):
    """Multi-turn agents: each turn's prompt is the last turn's prompt + reply + `tool_tokens` of tool
    output. Returns (wall seconds, prefill tokens computed, prefix tokens reused)."""

    async def agent(engine: BuiltinEngine, s: int) -> None:
        rng = random.Random(s)
        context = [rng.randrange(vocab) for _ in range(tool_tokens)]
        for t in range(turns):
            params = SamplingParams(max_tokens=reply, temperature=0)
            result = await generate(engine, GenerateRequest(f"s{s}.{t}", tuple(context), params))
            context += [*result.token_ids, *(rng.randrange(vocab) for _ in range(tool_tokens))]

    async def go():
        with BuiltinEngine(model, max_batch=sessions, prefix_cache_mb=prefix_cache_mb) as engine:
            await asyncio.gather(*(agent(engine, s) for s in range(sessions)))
            return (await engine.stats()).extra

    start = time.perf_counter()
    extra = asyncio.run(go())
    return time.perf_counter() - start, extra["prefill_tokens"], extra["prefix_cache_hit_tokens"]


@torch.no_grad()
def run_static(model, jobs: list[Job], batch: int, pad_id: int) -> tuple[int, float]:
    """(useful generated tokens, wall seconds) with left-padded static batches through `generate`."""
    useful = 0
    start = time.perf_counter()
    for lo in range(0, len(jobs), batch):
        group = jobs[lo : lo + batch]
        width = max(len(j.prompt) for j in group)
        ids = torch.tensor([[pad_id] * (width - len(j.prompt)) + list(j.prompt) for j in group])
        mask = torch.tensor([[0] * (width - len(j.prompt)) + [1] * len(j.prompt) for j in group])
        steps = max(j.max_tokens for j in group)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=pad_id
        )
        assert out.shape[1] == width + steps
        useful += sum(j.max_tokens for j in group)
    return useful, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=at_least(1), default=40, help="requests per measurement (default 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="16 requests of at most 64 new tokens (smoke test)")
    args = p.parse_args()
    n, max_new = (16, 64) if args.quick else (args.requests, 256)

    model, tok = default_model(args.seed)
    params = sum(t.numel() for t in model.parameters())
    jobs = make_jobs(n, args.seed, tok.vocab_size, 256, max_new)
    wanted = sum(j.max_tokens for j in jobs)
    print(
        f"model: tiny Qwen3 ({params / 1e6:.1f} M params, {model.config.num_hidden_layers} layers, "
        f"hidden {model.config.hidden_size}), torch threads {torch.get_num_threads()}"
    )
    print(f"workload: {n} requests, prompts 16..256 tokens, 16..{max_new} new tokens each ({wanted} in all), greedy")
    run_engine(model, jobs[:2], 2)  # warm-up
    run_static(model, jobs[:2], 2, tok.pad_token_id)

    header = ("concurrency", "engine tok/s", "generate tok/s", "ratio", "engine s", "generate s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, WIDTHS, strict=True)))
    for c in CONCURRENCY:
        e_tokens, e_s = run_engine(model, jobs, c)
        s_tokens, s_s = run_static(model, jobs, c, tok.pad_token_id)
        assert e_tokens == s_tokens == wanted
        e_rate, s_rate = e_tokens / e_s, s_tokens / s_s
        row = (f"{c}", f"{e_rate:.0f}", f"{s_rate:.0f}", f"{e_rate / s_rate:.2f}", f"{e_s:.1f}", f"{s_s:.1f}")
        print(" ".join(f"{v:>{w}}" for v, w in zip(row, WIDTHS, strict=True)))

    sessions, turns, tool, reply = (4, 3, 200, 16) if args.quick else (4, 8, 400, 32)
    print(f"\nmulti-turn agents: {sessions} sessions x {turns} turns, {tool} tool tokens + {reply} generated a turn")
    print(f"{'prefix cache':>12} {'wall s':>7} {'prefilled':>10} {'reused':>8}")
    walls = []
    for mb in (0.0, 256.0):
        wall, prefilled, reused = run_agents(model, mb, sessions, turns, tool, reply, tok.vocab_size)
        walls.append(wall)
        print(f"{'on' if mb else 'off':>12} {wall:7.1f} {prefilled:10d} {reused:8d}")
    print(f"speed-up from prefix caching: {walls[0] / walls[1]:.2f}x")


if __name__ == "__main__":
    main()
