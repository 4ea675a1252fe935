"""How long does a sandbox take to start, run a command and go away, alone and eight at once?

Times, over N sandboxes of the offline base image (built first if missing: about a minute or two),
`Sandbox.start` (create + start the container), `exec` of a trivial command (`true`: the fixed cost of a
command: exec create, the wrapper's fork of timeout and bash -lc, the stream, the exit status) and of a
small Python process, the same `true` through the sandbox's command runner (`Sandbox.start_shell`: one
exec for all of an agent's commands), and `close` (forced removal); and the CPU a `true` command costs
either way, on the Docker side (dockerd, containerd, its shims and the `runc` they start, read from /proc)
and in this client. Then eight sandboxes at once from eight threads,
each starting, running one command and closing, as eight concurrent agent episodes would on this
machine; it reports the wall time for all eight and each phase's spread. Last, grading throughput:
the gold patches of the shipped suite graded by `grading.DockerGrader` (a fresh sandbox each: checkout
copied in, patch and test patch applied, pytest run), `--grade-jobs` at a time, in instances per
minute. Needs a Docker daemon.

    python -m benchmarks.swe_sandbox [--n 10] [--execs 20] [--concurrent 8] [--grade 24] [--grade-jobs 2]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.harness import run_benchmark
from core.cli import at_least
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
    phases: dict[str, list[float]] = {
        "start": [],
        "exec true": [],
        "exec python3 -c pass": [],
        "runner true": [],
        "close": [],
    }
    for _ in range(n):
        dt, sandbox = timed(Sandbox(config).start)
        phases["start"].append(dt)
        try:
            for _ in range(execs):
                phases["exec true"].append(timed(sandbox.exec, "true", 60)[0])
            phases["exec python3 -c pass"].append(timed(sandbox.exec, "python3 -c pass", 60)[0])
            if not sandbox.start_shell():
                raise SystemExit("the command runner did not start in the base image")
            for _ in range(execs):
                phases["runner true"].append(timed(sandbox.exec, "true", 60)[0])
        finally:
            phases["close"].append(timed(sandbox.close)[0])
    return phases


def docker_cpu_s(container_id: str) -> float:
    """CPU seconds used so far by dockerd, containerd and the container's shim, each with the children it has
    waited for (the `runc` processes that start a command). Other containers' shims are left out: they come and
    go, and their CPU would leave the sum with them."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            text = open(f"{proc}/stat").read()
            argv = open(f"{proc}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if name in ("dockerd", "containerd") or (name.startswith("containerd-shim") and container_id in argv):
            total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return total / tick


def command_cpu(config: SandboxConfig, n: int) -> dict[str, tuple[float, float]]:
    """(Docker side, this client) CPU seconds a `true` command costs, through docker exec and the runner."""
    found = {}
    with Sandbox(config) as sandbox:
        for way in ("docker exec", "runner"):
            if way == "runner":
                sandbox.start_shell()
            sandbox.exec("true", 60)
            docker0, me0 = docker_cpu_s(sandbox.id), time.process_time()
            for _ in range(n):
                sandbox.exec("true", 60)
            found[way] = ((docker_cpu_s(sandbox.id) - docker0) / n, (time.process_time() - me0) / n)
    return found


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


def steady(config: SandboxConfig, k: int, execs: int, runner: bool) -> tuple[float, list[float]]:
    """k live sandboxes, each running `execs` trivial commands from its own thread at once."""
    sandboxes = [Sandbox(config) for _ in range(k)]
    try:
        with ThreadPoolExecutor(k) as pool:
            list(pool.map(Sandbox.start, sandboxes))
            if runner:
                list(pool.map(Sandbox.start_shell, sandboxes))
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
    parser.add_argument("--n", type=at_least(1), default=10, help="sandboxes started one after another")
    parser.add_argument("--execs", type=at_least(1), default=20, help="`true` commands per sandbox")
    parser.add_argument("--concurrent", type=at_least(1), default=8, help="sandboxes at once")
    parser.add_argument("--grade", type=at_least(0), default=24, help="shipped tasks graded (gold patches)")
    parser.add_argument("--grade-jobs", type=at_least(1), default=2, help="gradings at once")
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
    print(f"\nCPU a `true` command costs ({args.execs * args.n} commands):")
    for way, (docker_s, client_s) in command_cpu(config, args.execs * args.n).items():
        print(f"  {way:22s} Docker side {1e3 * docker_s:6.1f} ms, this client {1e3 * client_s:5.1f} ms")
    print(f"\n{args.concurrent} live sandboxes, each running {args.execs} `true` commands at once:")
    for runner in (False, True):
        wall_s, samples = steady(config, args.concurrent, args.execs, runner)
        way = "runner true" if runner else "exec true"
        print(f"  {way:22s} {len(samples) / wall_s:6.1f} commands/s in all; {spread(samples)}")
    wall_s, samples, resolved = grading(image, args.grade, args.grade_jobs)
    print(f"\ngrading {len(samples)} gold patches of the shipped suite, {args.grade_jobs} at a time:")
    print(f"  {60 * len(samples) / wall_s:.1f} instances/min ({resolved} resolved)")
    print(f"  {'one grading':22s} {spread(samples)}")


if __name__ == "__main__":
    run_benchmark(main)
