"""What does a generate call's prompt cost on the wire to an engine, packed against a JSON list?

The trajectory manager sends every turn's whole prompt to an engine (the engine's prefix cache, not the wire,
saves the recomputation), and an agent's prompt grows to tens of thousands of tokens. Writing the call
(`request_to_wire` + `json.dumps`, on the manager's event loop) and reading it back (`json.loads` +
`parse_generate`, in the engine's process) are timed at 1,000 to 32,000 prompt tokens, with the prompt as
`prompt_ids_b64` (what the manager sends) and as a JSON list of integers (what the server also reads). CPU
milliseconds a call, the median of `--reps` calls after one untimed call. Runs in a few seconds.

    python -m benchmarks.engine_wire [--reps 50]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

from benchmarks.harness import run_benchmark
from reference.engine.base import GenerateRequest, SamplingParams
from reference.engine.wire import parse_generate, request_to_wire

SIZES = (1_000, 8_000, 32_000)


def cpu_ms(fn: Callable[[], object], reps: int) -> float:
    """The median CPU milliseconds of `fn()` over `reps` calls, after one untimed call."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.process_time_ns()
        fn()
        samples.append((time.process_time_ns() - start) / 1e6)
    return statistics.median(samples)


def as_list(request: GenerateRequest, wire: dict) -> dict:
    """The call `wire` with `request`'s prompt as a JSON list of integers."""
    rest = {k: v for k, v in wire.items() if k != "prompt_ids_b64"}
    return {"prompt_token_ids": list(request.prompt_token_ids), **rest}


def figures(request: GenerateRequest, reps: int) -> tuple[float, float, float, float, int, int]:
    """CPU ms to write the call packed and listed, to read it back packed and listed; the two bodies' bytes."""
    packed = request_to_wire(request)
    packed_text, listed_text = json.dumps(packed), json.dumps(as_list(request, packed))
    return (
        cpu_ms(lambda: json.dumps(request_to_wire(request)), reps),
        cpu_ms(lambda: json.dumps(as_list(request, packed)), reps),
        cpu_ms(lambda: parse_generate(json.loads(packed_text)), reps),
        cpu_ms(lambda: parse_generate(json.loads(listed_text)), reps),
        len(packed_text),
        len(listed_text),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50, help="timed calls per figure (default 50)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    rng = random.Random(0)
    print("prompt tokens | write packed / list (ms) | read packed / list (ms) | bytes packed / list")
    for n in SIZES:
        request = GenerateRequest("r", tuple(rng.randrange(151_643) for _ in range(n)), SamplingParams(max_tokens=16))
        write_p, write_l, read_p, read_l, size_p, size_l = figures(request, args.reps)
        print(
            f"{n:13,} | {write_p:7.2f} / {write_l:6.2f}       | {read_p:6.2f} / {read_l:6.2f}      | "
            f"{size_p:,} / {size_l:,}"
        )


if __name__ == "__main__":
    run_benchmark(main)
