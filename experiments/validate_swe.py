"""The SWE workload of `experiments.validate` (`--workload swe`): one warm start every run begins from, the
sandboxes' times measured alone (a command, a test run, a workspace's start, and how much longer their work
takes while every core is busy), and each round's episodes as the simulator's workload (the lengths the round's
runs played, read from their stores, and the share of samples whose advantage is 0).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments.cpu_sampler import docker_cpu_s
from experiments.validate_setup import run_dir


def warm_weights(rt, task, out: Path) -> str:
    """The checkpoint every SWE run starts from: `make train-swe`'s warm start on the demonstrations, once,
    under `out`/warm (its metrics.jsonl and weights)."""
    from reference.control.layout import initial_weights
    from reference.control.report import MetricsLog
    from reference.control.warm_start import warm_start

    where = out / "warm"
    where.mkdir(parents=True, exist_ok=True)
    print("warm start: fitting fresh weights on the demonstrations, as make train-swe does ...", flush=True)
    fresh = initial_weights(rt, task, where / "fresh")
    return warm_start(rt, task, where, fresh, MetricsLog(where / "metrics.jsonl"))


def measure_sandboxes(task, starts: int = 8) -> dict:
    """The SWE workload's sandbox times (`tool_latency_s`, `test_run_s`), a part measured alone: the train split's
    demonstrations, one at a time, their commands timed in workspaces from a sandbox pool as the runs' (containers
    started ahead), their patches graded in its graders (`swebench_env.sim_workload.time_episodes`). Beside them,
    what the simulator does not model yet: the CPU-seconds an episode's sandboxes cost the Docker daemon and the
    containers (`docker_cpu_s`, an episode's mean) and this process (`client_cpu_s`); a workspace's start alone
    (`start_s`: a pool without spares, from the lease to its first command's end; `starts` of them) and how many
    start at once (`start_slots`: `starts` workspaces asked for together take `starts` x the median start over
    this many lanes; `start_together_s`, their last one's seconds); and how many times longer `starts` of the
    episodes' sandbox work takes while every core is busy (`busy_stretch`)."""
    from swebench_env.pool import SandboxPool
    from swebench_env.sim_workload import fit, time_episodes

    c = task.config
    pairs = _demonstrations(task)
    print(f"measuring: the sandboxes ({len(pairs)} demonstrations' commands and grading, in Docker) ...", flush=True)
    with SandboxPool(c.concurrency, c.spare_sandboxes) as pool:
        docker, own = docker_cpu_s(), time.process_time()
        timed = time_episodes(pairs, timeout_s=c.command_timeout_s, environments=_pooled(pool, c))
        docker, own = docker_cpu_s() - docker, time.process_time() - own
    from concurrent.futures import ThreadPoolExecutor

    def started(pool, instance) -> float:
        start = time.monotonic()
        with pool.episode(c.image, c.test_timeout_s).workspace(instance) as runner:
            runner.exec("true", c.command_timeout_s)
            return time.monotonic() - start

    instances = [instance for instance, _ in pairs[:starts]]
    with SandboxPool(1, 0) as pool:
        seconds = [started(pool, instance) for instance in instances]
    with SandboxPool(len(instances), 0) as pool, ThreadPoolExecutor(len(instances)) as threads:
        together = max(threads.map(lambda instance: started(pool, instance), instances))
    lanes = max(1, min(len(instances), round(len(instances) * statistics.median(seconds) / together)))
    return {
        **timed,
        "docker_cpu_s": docker / len(pairs),
        "client_cpu_s": own / len(pairs),
        "start_s": fit(seconds, integer=False),
        "start_slots": lanes,
        "start_together_s": together,
        **busy_stretch(task, starts),
    }


def _pooled(pool, c):
    """`time_episodes`' environments: each episode's workspace and grader from `pool`, as a run's (config `c`)."""

    def environments():
        sandboxes = pool.episode(c.image, c.test_timeout_s)
        return sandboxes.workspace, sandboxes.grader

    return environments


def _demonstrations(task) -> list:
    """The train split's (task, demonstration) pairs."""
    from swebench_env.suite import load_suite_demonstrations

    demos = {d.instance_id: d for d in load_suite_demonstrations("all")}
    return [(t, demos[t.instance_id]) for t in task.instances["train"] if t.instance_id in demos]


BUSY_EPISODES = 8  # episodes `busy_stretch` times (alone and with every core busy)


def busy_stretch(task, episodes: int = BUSY_EPISODES, repeats: int = 3) -> dict:
    """How many times longer a sandbox's work takes while every core is busy (`busy_stretch`, the simulator's
    `workload.sandbox_busy_stretch`): `episodes` demonstrations, each a workspace started from an empty pool,
    its commands and its grading, timed alone and then with one CPU-bound process pinned to each core (as the
    runtime's engines and trainers are), `repeats` times in turn (`alone_s`, `busy_s`: each time's seconds). The
    daemon, the containers and this process's threads then get the cores only in their turns."""
    from swebench_env.pool import SandboxPool
    from swebench_env.sim_workload import time_episodes

    c = task.config
    pairs = _demonstrations(task)[:episodes]
    print(f"measuring: {len(pairs)} episodes' sandbox work alone and with every core busy ...", flush=True)

    def once() -> float:
        start = time.monotonic()
        with SandboxPool(1, 0) as pool:
            time_episodes(pairs, timeout_s=c.command_timeout_s, environments=_pooled(pool, c))
        return time.monotonic() - start

    alone, busy = [], []
    for _ in range(repeats):
        alone.append(once())
        with spinning(sorted(os.sched_getaffinity(0))):
            busy.append(once())
    stretch = max(1.0, statistics.median(busy) / statistics.median(alone))
    return {"alone_s": alone, "busy_s": busy, "busy_stretch": stretch, "busy_episodes": len(pairs)}


def sandbox_cpu_cores(sandboxes: dict) -> float | None:
    """The cores a sandbox's work uses while it runs alone (the simulator's `workload.sandbox_cpu_cores`): an
    episode's sandboxes' CPU-seconds alone (the daemon and the containers, and the client) over the seconds
    an episode's sandbox work takes alone (`busy_stretch`'s runs: a workspace's start, its commands, its
    grading). None without those measurements."""
    if "alone_s" not in sandboxes or "docker_cpu_s" not in sandboxes:
        return None
    episode_s = statistics.median(sandboxes["alone_s"]) / sandboxes.get("busy_episodes", BUSY_EPISODES)
    return (sandboxes["docker_cpu_s"] + sandboxes.get("client_cpu_s", 0.0)) / episode_s


@contextlib.contextmanager
def spinning(cores: list[int]):
    """One CPU-bound process pinned to each of `cores` while the block runs."""
    code = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(core)]) for core in cores]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def zero_advantage_share(stores, negative_weight: float, normalize_std: bool) -> float | None:
    """The share of the runs' episodes whose advantage is 0 (the trainer's `_without_gradient`): each finished
    group's newest record in the stores (its episodes' rewards), advantages as the trainer computes them. None
    when the stores hold no group."""
    from reference.manager.store import TrajectoryStore
    from reference.rollout.groups import newest_group_records
    from reference.trainer.advantages import group_advantages

    zero = total = 0
    for path in stores:
        with TrajectoryStore(path) as store:
            groups = {
                key: [float(e["reward"]) for e in store.annotations(sid)["meta"]["episodes"]]
                for key, sid in newest_group_records(store).items()
            }
        for key, rewards in groups.items():
            advantages = group_advantages(rewards, [key] * len(rewards), normalize_std, negative_weight=negative_weight)
            zero += sum(a == 0 for a in advantages)
            total += len(advantages)
    return zero / total if total else None


def round_workload(
    runtime: Path, policies: tuple[str, ...], round_: int, repeats: int, sandboxes: dict, trainer: dict | None = None
) -> dict:
    """The SWE workload the simulator runs for a round: the lengths of the episodes the round's runs played
    (their stores, every policy's together: turns, prompt, replies, tool outputs; `fit_stores`) and the
    sandboxes' times measured alone (`measure_sandboxes`). The runs' lengths are an input, as the throughput
    task's length distributions are: the policy's behaviour, not a cost. With the runs' `trainer` settings,
    when that trainer skips the gradient of samples whose advantage is 0 (no KL or entropy term), their share
    of the runs' episodes (`zero_advantage_share`, for the simulator's train section): the rewards are the
    policy's behaviour too."""
    from reference.trainer.config import TrainerConfig
    from swebench_env.sim_workload import fit_stores

    stores = [run_dir(runtime, p, round_, repeats) / "trajectories.sqlite" for p in policies]
    out = {
        "kind": "swe",
        **fit_stores(stores),
        "tool_latency_s": sandboxes["tool_latency_s"],
        "test_run_s": sandboxes["test_run_s"],
    }
    if "start_s" in sandboxes:  # a container's start, and how many start at once
        out.update(sandbox_start_s=sandboxes["start_s"], sandbox_start_slots=sandboxes.get("start_slots", 1))
    if "busy_stretch" in sandboxes:  # the sandboxes' work slowed by busy cores
        out["sandbox_busy_stretch"] = sandboxes["busy_stretch"]
    if (cpu := sandbox_cpu_cores(sandboxes)) is not None:  # and sharing the cores when many work at once
        out["sandbox_cpu_cores"] = cpu
    if trainer is not None:
        t = TrainerConfig.from_dict(dict(trainer))
        if t.kl_coef == 0 and t.entropy_coef == 0:  # the trainer's `_drops_inert` (the runtime runs no FSDP)
            share = zero_advantage_share(stores, t.negative_weight, t.normalize_std)
            if share is not None:
                out["zero_advantage_share"] = share
    return out
