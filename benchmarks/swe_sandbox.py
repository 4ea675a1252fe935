"""How long does a sandbox take to start, run a command and go away, alone and eight at once?

Times, over N sandboxes of the offline base image (built first if missing: about a minute or two),
`Sandbox.start` (create + start the container), `exec` of a trivial command (`true`: the fixed cost of a
command: exec create, the wrapper's fork of timeout and bash -lc, the stream, the exit status) and of a
small Python process, and `close` (forced removal). Then eight sandboxes at once from eight threads,
each starting, running one command and closing, as eight concurrent agent episodes would on this
machine; it reports the wall time for all eight and each phase's spread. Last, grading throughput:
the gold patches of the shipped suite graded by `grading.DockerGrader` (a fresh sandbox each: checkout
copied in, patch and test patch applied, pytest run), `--grade-jobs` at a time, in instances per
minute. Needs a Docker daemon.

    python -m benchmarks.swe_sandbox [--n 10] [--execs 20] [--concurrent 8] [--grade 24] [--grade-jobs 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from swebench_env.grading import DockerGrader, DockerGraderConfig
from swebench_env.images import ensure_base_image
from swebench_env.sandbox import Sandbox, SandboxConfig
from swebench_env.suite import load_suite


def spread(samples_s: list[float]) -> str:
    ms = [1e3 * s for s in samples_s]
    return f"min {min(ms):7.1f}  median {statistics.median(ms):7.1f}  max {max(ms):7.1f} ms  (n={len(ms)})"


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def sequential(config: SandboxConfig, n: int, execs: int) -> dict[str, list[float]]:
    """Start, exec (`true` and a Python process) and close, one sandbox after another."""
    phases: dict[str, list[float]] = {"start": [], "exec true": [], "exec python3 -c pass": [], "close": []}
    for _ in range(n):
        dt, sandbox = timed(Sandbox(config).start)
        phases["start"].append(dt)
        try:
            for _ in range(execs):
                phases["exec true"].append(timed(sandbox.exec, "true", 60)[0])
            phases["exec python3 -c pass"].append(timed(sandbox.exec, "python3 -c pass", 60)[0])
        finally:
            phases["close"].append(timed(sandbox.close)[0])
    return phases


def episode(config: SandboxConfig) -> dict[str, float]:
    """One sandbox's life: start, one command, close."""
    dt_start, sandbox = timed(Sandbox(config).start)
    try:
        dt_exec, result = timed(sandbox.exec, "python3 -c 'print(sum(range(10**6)))'", 120)
        assert result.exit_code == 0, result
    finally:
        dt_close = timed(sandbox.close)[0]
    return {"start": dt_start, "exec": dt_exec, "close": dt_close}


def concurrent(config: SandboxConfig, k: int) -> tuple[float, dict[str, list[float]]]:
    with ThreadPoolExecutor(k) as pool:
        wall_s, runs = timed(lambda: list(pool.map(lambda _: episode(config), range(k))))
    return wall_s, {phase: [run[phase] for run in runs] for phase in ("start", "exec", "close")}


def steady(config: SandboxConfig, k: int, execs: int) -> tuple[float, list[float]]:
    """k live sandboxes, each running `execs` trivial commands from its own thread at once."""
    sandboxes = [Sandbox(config) for _ in range(k)]
    try:
        with ThreadPoolExecutor(k) as pool:
            list(pool.map(Sandbox.start, sandboxes))
            run = lambda sb: [timed(sb.exec, "true", 60)[0] for _ in range(execs)]
            wall_s, per_sandbox = timed(lambda: list(pool.map(run, sandboxes)))
    finally:
        for sandbox in sandboxes:
            sandbox.close()
    return wall_s, [dt for samples in per_sandbox for dt in samples]


def grading(image: str, n: int, jobs: int) -> tuple[float, list[float], int]:
    """Grade the gold patches of the first `n` shipped tasks, `jobs` at a time: (wall s, per-instance s, resolved)."""
    tasks = load_suite("all")[:n]
    grader = DockerGrader(DockerGraderConfig(image=image))

    def one(task):
        dt, evaluation = timed(grader, task, task.patch)
        return dt, evaluation.resolved

    with ThreadPoolExecutor(jobs) as pool:
        wall_s, runs = timed(lambda: list(pool.map(one, tasks)))
    return wall_s, [dt for dt, _ in runs], sum(ok for _, ok in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10, help="sandboxes started one after another")
    parser.add_argument("--execs", type=int, default=20, help="`true` commands per sandbox")
    parser.add_argument("--concurrent", type=int, default=8, help="sandboxes at once")
    parser.add_argument("--grade", type=int, default=24, help="shipped tasks graded (gold patches)")
    parser.add_argument("--grade-jobs", type=int, default=2, help="gradings at once")
    args = parser.parse_args()

    dt, image = timed(ensure_base_image)
    config = SandboxConfig(image=image)
    print(
        f"image {image} (ready in {dt:.1f} s); {os.cpu_count()} cores; limits: {config.cpus} cpu, "
        f"{config.memory_mb} MiB, {config.pids_limit} pids, network off"
    )
    timed(lambda: sequential(config, 1, 1))  # warm-up: first-use costs (reaper, page cache) stay out
    print(f"\none at a time, {args.n} sandboxes:")
    for phase, samples in sequential(config, args.n, args.execs).items():
        print(f"  {phase:22s} {spread(samples)}")
    wall_s, phases = concurrent(config, args.concurrent)
    print(f"\n{args.concurrent} at once (start, one python3 command, close, each in its own thread):")
    print(f"  all {args.concurrent} done in {wall_s:.2f} s wall")
    for phase, samples in phases.items():
        print(f"  {phase:22s} {spread(samples)}")
    wall_s, samples = steady(config, args.concurrent, args.execs)
    print(f"\n{args.concurrent} live sandboxes, each running {args.execs} `true` commands at once:")
    print(f"  {len(samples) / wall_s:.1f} commands/s in all")
    print(f"  {'exec true':22s} {spread(samples)}")
    wall_s, samples, resolved = grading(image, args.grade, args.grade_jobs)
    print(f"\ngrading {len(samples)} gold patches of the shipped suite, {args.grade_jobs} at a time:")
    print(f"  {60 * len(samples) / wall_s:.1f} instances/min ({resolved} resolved)")
    print(f"  {'one grading':22s} {spread(samples)}")


if __name__ == "__main__":
    main()
