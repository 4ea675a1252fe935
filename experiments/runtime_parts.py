"""The runtime's parts, each measured alone on this machine, for `experiments.validate` (`make validate`).

Each part runs on one core with one torch thread (what one runtime resource has): the device's peaks, the
built-in engine as the runtime deploys it (its own process, over HTTP), the host's work a generated token
(the trajectory and rollout managers feeding that engine), the runtime's GRPO trainer on batches drawn from
the workload, reading a step's batch from a trajectory store, publishing and loading weights, pausing and
resuming an engine. No whole run is used here.

The trainer's parts, and `fit_trainer`, which turns its steps into the simulator's `train_mfu`,
`train_attention_mfu` and `train_step_overhead_s`, are in `trainer_parts.py`. The device's peaks are timed with
reference/measure.py, as benchmarks/gpu_calibration.py times its own.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from experiments.trainer_parts import workload_batch

DEVICE_NAME = "cpu-core"


@dataclass(frozen=True)
class Grid:
    batches: tuple[int, ...]  # decode: sequences a step
    contexts: tuple[int, ...]  # decode: prompt tokens of each sequence
    decode_tokens: int  # decode: tokens generated a point (after the first)
    prefill_tokens: tuple[int, ...]
    train_sequences: tuple[int, ...]  # trainer: batch sizes, lengths drawn from the workload
    repeats: int
    host_groups: int  # the host's work: groups of the workload a round
    train_shape_tokens: int  # trainer: tokens of each batch of sequences of one length (TRAIN_SHAPES)
    placement_rounds: int  # the host's placement beside a busy trainer: rounds (its median), after a warm-up
    sync_every_s: float = 0.25  # a sync in place: one this often while the engine generates (each empties the
    # engine's prefix cache: an agent's long contexts prefilled again must fit between two)


FULL = Grid((1, 8, 32, 64, 128), (8, 64, 192), 24, (8, 32, 128, 512), (64, 128, 256), 3, 16, 8192, 5)
QUICK = Grid((1, 8, 32), (8, 64), 8, (8, 64), (16, 32), 1, 4, 1024, 1)


@contextmanager
def one_core():
    """This process on one core with one torch thread (a runtime resource's share), restored after."""
    import torch

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {min(cores)})
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, cores)


def measure_device(repeats: int = 10) -> dict:
    """One core's fp32 matmul FLOP/s and memory-copy bandwidth, as a device file's fields."""
    import torch

    from reference.measure import copy_gb_s, matmul_tflops

    cpu = torch.device("cpu")
    tflops = matmul_tflops(1024, cpu, torch.float32, warmup=0, runs=repeats)  # the best of `repeats` products
    bandwidth, _, _ = copy_gb_s(64 << 20, cpu, warmup=0, runs=repeats)  # read + write
    return {
        "name": DEVICE_NAME,
        "description": "one core of the machine that ran the validation (measured: fp32 matmul, memory copy)",
        "peak_tflops": round(tflops, 6),
        "hbm_gb": 1000.0,  # the built-in engine's cache grows with its batch: memory is not a limit here
        "hbm_bandwidth_gb_s": round(bandwidth, 3),
        # Weights move between processes through memory (a published file, read back): copy speed.
        "nvlink_gb_s": round(bandwidth, 3),
        "network_gb_s": round(bandwidth, 3),
        "pcie_gb_s": round(bandwidth, 3),
        "gpus_per_node": 64,
    }


def measure_engine(model_config, tokenizer, grid: Grid, engine_cores: set[int], client_cores: set[int]) -> tuple:
    """(decode points, prefill points) of the built-in engine as the runtime deploys it: a process of its
    own on `engine_cores` with one torch thread, called over HTTP from this process on `client_cores`
    (sim/profile.py records). A decode point is the engine's own seconds a decode step (its `decode_s` over
    its `steps`: the step, and the time its process spends between steps streaming the tokens out) over a
    batch of requests forced to the same length, so neither the prefill nor this client's speed in reading
    the tokens is in it; a prefill point is a one-token request's seconds."""
    from reference.engine.base import GenerateRequest, SamplingParams, generate
    from reference.engine.process import EngineProcess, EngineSpec
    from reference.model import build_model
    from reference.trainer.handoff import publish_weights
    from sim.profile import DecodePoint, PrefillPoint

    rng, vocab = random.Random(0), model_config.vocab_size
    ids = iter(range(1 << 30))

    def prompts(batch: int, context: int) -> list[tuple[int, ...]]:
        return [tuple(rng.randrange(vocab) for _ in range(context)) for _ in range(batch)]

    async def step_s(engine, batch: int, context: int, tokens: int) -> float:
        before = (await engine.stats()).extra
        params = SamplingParams(max_tokens=tokens, temperature=1.0)
        await asyncio.gather(
            *(generate(engine, GenerateRequest(f"v{next(ids)}", p, params)) for p in prompts(batch, context))
        )
        after = (await engine.stats()).extra
        steps = after["steps"] - before["steps"]  # a step or two more where requests arrive a step apart
        if steps < tokens:
            raise RuntimeError(f"the engine took {steps} decode steps for {tokens} forced tokens a request")
        return (after["decode_s"] - before["decode_s"]) / steps

    async def request_s(engine, context: int) -> float:
        params = SamplingParams(max_tokens=1, temperature=1.0)
        start = time.perf_counter()
        await generate(engine, GenerateRequest(f"v{next(ids)}", prompts(1, context)[0], params))
        return time.perf_counter() - start

    async def go(client) -> tuple[list, list]:
        decode, prefill = [], []
        try:
            await step_s(client, 4, 8, 4)  # warm-up
            for batch in grid.batches:
                for context in grid.contexts:
                    steps = [await step_s(client, batch, context, grid.decode_tokens + 1) for _ in range(grid.repeats)]
                    decode.append(DecodePoint(batch, context + grid.decode_tokens // 2, statistics.median(steps)))
            for tokens in grid.prefill_tokens:
                seconds = statistics.median([await request_s(client, tokens) for _ in range(grid.repeats)])
                prefill.append(PrefillPoint(tokens, seconds))
        finally:
            await client.close()
        return decode, prefill

    with tempfile.TemporaryDirectory() as root:
        weights = publish_weights(build_model(model_config).state_dict(), model_config, root, 0, tokenizer).path
        mask = os.sched_getaffinity(0)
        os.sched_setaffinity(0, engine_cores)  # the engine process inherits it
        try:
            engine = EngineProcess(EngineSpec(model=str(weights), max_batch=max(grid.batches), torch_threads=1))
        finally:
            os.sched_setaffinity(0, client_cores)
        try:
            return asyncio.run(go(engine.client()))
        finally:
            engine.close()
            os.sched_setaffinity(0, mask)


def measure_host(
    model_config,
    task,
    rt_cfg,
    engine_cores: set[int],
    client_cores: set[int],
    groups: int,
    repeats: int,
    weights: str | None = None,
) -> dict:
    """The host's CPU-seconds a generated token (`costs.host_token_s`): this process, on `client_cores`, runs the
    runtime's trajectory manager (embedded, as the driver holds it) and rollout manager with the run's rollout
    settings, `groups` groups of the workload at a time through one built-in engine process on `engine_cores`;
    the CPU time of every thread of this process (`time.process_time`) over the tokens the engine generated,
    the median of `repeats` rounds (a warm-up round first). What the driver does besides (the policy, Ray calls
    to the trainers, the timeline's sampling) is not in it. `weights`: the engine's checkpoint (None: fresh
    weights of `model_config`; an agent task wants weights that act like the run's)."""
    with _host_feeding_an_engine(model_config, task, rt_cfg, engine_cores, client_cores, weights) as rig:
        rounds = rig.rounds(groups, repeats)
    per_token = [cpu / max(1, tokens) for _, _, cpu, tokens in rounds]
    return {
        "host_token_s": statistics.median(per_token),
        "rounds": [{"cpu_s": cpu, "tokens": tokens} for _, _, cpu, tokens in rounds],
    }


@contextmanager
def _host_feeding_an_engine(
    model_config, task, rt_cfg, engine_cores: set[int], client_cores: set[int], weights: str | None = None
):
    """One built-in engine process on `engine_cores` (it inherits the mask), this process on `client_cores`
    running the runtime's trajectory manager (embedded, as the driver holds it) in front of it; yields a
    `_HostRig` whose rounds feed it groups of the workload through the run's rollout manager. The engine serves
    `weights` (a checkpoint directory), or fresh weights of `model_config`."""
    from reference.engine.process import EngineProcess, EngineSpec
    from reference.manager.embedded import ManagerThread
    from reference.manager.manager import ManagerConfig
    from reference.model import build_model
    from reference.trainer.handoff import publish_weights

    config = ManagerConfig(model_name="seamlessflow-host", max_pause_s=0, max_in_flight_requests=0, max_loop_lag_s=0)
    with tempfile.TemporaryDirectory() as root:
        if weights is None:
            weights = publish_weights(
                build_model(model_config).state_dict(), model_config, root, 0, task.tokenizer
            ).path
        mask = os.sched_getaffinity(0)
        os.sched_setaffinity(0, engine_cores)  # the engine process inherits it
        try:
            engine = EngineProcess(
                EngineSpec(
                    model=str(weights),
                    max_batch=rt_cfg.engine.max_batch,
                    torch_threads=1,
                    coalesce_s=rt_cfg.engine.coalesce_s,
                    logprobs_mode=rt_cfg.engine.logprobs_mode,
                )
            )
        finally:
            os.sched_setaffinity(0, client_cores)
        try:
            with (
                engine,
                ManagerThread({"host": engine.client()}, task.tokenizer, Path(root) / "store.sqlite", config) as m,
            ):
                yield _HostRig(m, task, rt_cfg, str(weights))
        finally:
            os.sched_setaffinity(0, mask)


class _HostRig:
    """`_host_feeding_an_engine`'s engine ("host") behind an embedded trajectory manager `m`."""

    def __init__(self, m, task, rt_cfg, weights: str) -> None:
        from reference.rollout.groups import RolloutConfig

        r = rt_cfg.rollout
        self.m, self.task, self.weights = m, task, weights
        self.rollout_config = RolloutConfig(r.group_size, r.max_concurrency, r.temperature)

    def rounds(self, groups: int, repeats: int) -> list[tuple[float, float, float, int]]:
        """`repeats` rounds after a warm-up one, each the run's rollout manager feeding the engine `groups` groups
        at a time: each round's (start, end, this process's CPU seconds, generated tokens)."""
        return [self.m.call(self._round(seed, groups), timeout_s=600)[0] for seed in range(repeats + 1)][1:]

    def syncs(self, groups: int, every_s: float, idle: int = 5, least: int = 3) -> tuple[list[float], list[float]]:
        """Weight syncs the way the runtime's executor does them (`RuntimeExecutor._sync`, on the manager's event
        loop: pause at a token boundary, restart requests older than the bound, load a version, resume), each
        timed up to its load, as the runtime's sync interval ends there for an engine that still holds
        requests (the policy resumes it at once): `idle` of them with nothing generating, after a warm-up round,
        then one every `every_s` seconds through a round of `groups` groups (rounds of twice as many again, up to
        three more, until `least` syncs landed inside generation: a fast machine may finish a round before the
        first). Returns (idle, generating)."""
        self.m.call(self._round(0, groups), timeout_s=600)
        alone = [self.m.call(self._sync(version), timeout_s=60) for version in range(1, idle + 1)]
        busy: list[float] = []
        for more in range(4):
            busy += self.m.call(self._round(1 + more, groups << more, every_s), timeout_s=600)[1]
            if len(busy) >= least:
                break
        return alone, busy

    async def _sync(self, version: int) -> float:
        """One sync as `syncs` describes it, resumed after: its seconds up to the load."""
        manager, start = self.m.manager, time.perf_counter()
        await manager.pause(["host"])
        await manager.restart_older_than(0, ["host"])
        await manager.update_weights(version, self.weights, ["host"])
        seconds = time.perf_counter() - start
        await manager.resume(["host"])
        return seconds

    async def _round(self, seed: int, groups: int, sync_every_s: float | None = None):
        from reference.rollout.groups import RolloutManager

        finished, synced = asyncio.Queue(), []

        async def keep_syncing() -> None:
            version = 100
            while True:
                await asyncio.sleep(sync_every_s)
                synced.append(await self._sync(version))
                version += 1

        async with RolloutManager(
            self.task, self.m.url, self.rollout_config, f"host{seed}", seed, finished.put_nowait
        ) as rollout:
            start, cpu = time.perf_counter(), time.process_time()
            rollout.submit(groups)
            syncing = asyncio.create_task(keep_syncing()) if sync_every_s else None
            try:
                done = [await finished.get() for _ in range(groups)]
            finally:
                if syncing is not None:
                    syncing.cancel()
                    await asyncio.gather(syncing, return_exceptions=True)
                    await self.m.manager.resume(["host"])  # a sync cut short leaves no paused engine
            end, cpu = time.perf_counter(), time.process_time() - cpu
        return (start, end, cpu, sum(e.tokens for g in done for e in g.episodes)), synced


def measure_sync_in_place(
    model_config,
    task,
    rt_cfg,
    engine_cores: set[int],
    client_cores: set[int],
    groups: int,
    every_s: float = 0.25,
    weights: str | None = None,
) -> dict:
    """A weight sync as a run meets it: the built-in engine in its own process behind the runtime's trajectory
    manager, synced through the manager's own calls as the executor syncs it (`_HostRig.syncs`). `sync_s`
    (`costs.sync_fixed_s`): the median of syncs with nothing generating; `sync_busy_s` (`costs.sync_busy_s`):
    what a sync takes beyond that while the engine generates for the run's rollout manager, one every `every_s`
    seconds through a round of `groups` groups (the median): the pause waits for the engine's step to end and for
    the manager's event loop, busy streaming every request's tokens. Both with every sync's seconds. `weights`:
    as `measure_host`'s."""
    with _host_feeding_an_engine(model_config, task, rt_cfg, engine_cores, client_cores, weights) as rig:
        idle, busy = rig.syncs(groups, every_s)
    if not busy:
        raise RuntimeError(f"no weight sync completed in a round of {groups} groups (one every {every_s} s)")
    alone = statistics.median(idle)
    return {
        "sync_s": alone,
        "sync_busy_s": max(0.0, statistics.median(busy) - alone),
        "idle_s": idle,
        "generating_s": busy,
    }


def measure_host_placement(
    model_config,
    task,
    rt_cfg,
    engine_core: int,
    train_core: int,
    groups: int,
    repeats: int,
    trainer_config: dict,
    weights: str | None = None,
) -> dict:
    """Where the host's work runs when a rollout core and a training core are both busy
    (`costs.host_train_placement`): one built-in engine process on `engine_core` serving this process's
    trajectory and rollout managers (`groups` groups a round), and a trainer process on `train_core` stepping
    without pause, this process free to run on either core as the runtime's driver is. The trainer's share of
    its core (its thread's CPU time over wall time, steps that lie within a round) falls by the host's cores
    that land on it; over the host's CPU in the round (this process's), that is the share of the host's work
    a busy training core takes when one rollout core is busy beside it: the placement p (sim/host.py), the
    median of `repeats` rounds after a warm-up round. 0.5 is an even spread. `weights`: as `measure_host`'s."""
    import multiprocessing
    import queue

    group = rt_cfg.rollout.group_size
    batch = workload_batch(model_config, task, group, group, random.Random(2))  # one group: a short step
    ctx = multiprocessing.get_context("spawn")
    steps, stop = ctx.Queue(), ctx.Event()
    trainer = ctx.Process(
        target=_busy_trainer,
        args=(train_core, model_config, trainer_config, task.tokenizer.pad_token_id, batch, stop, steps),
    )
    records: list[tuple[float, float, float]] = []
    with _host_feeding_an_engine(model_config, task, rt_cfg, {engine_core}, {engine_core, train_core}, weights) as rig:
        trainer.start()
        try:
            for _ in range(3):  # warm-up steps
                records.append(_next_step(steps, trainer))
            alone_from = time.perf_counter()
            # the trainer alone (its baseline share), for a second or three of its steps, whichever is longer
            time.sleep(max(1.0, 3 * max(end - start for start, end, _ in records[-2:])))
            alone_to = time.perf_counter()
            rounds = rig.rounds(groups, repeats)
        finally:
            stop.set()
            deadline = time.monotonic() + 120  # its last step, then it exits once its queue is read
            while True:
                try:
                    records.append(steps.get(timeout=1))
                except queue.Empty:
                    if not trainer.is_alive() or time.monotonic() > deadline:
                        break
            trainer.join(timeout=10)
            if trainer.is_alive():
                trainer.kill()

    def share(lo: float, hi: float) -> float | None:
        inside = [(end - start, cpu) for start, end, cpu in records if start >= lo and end <= hi]
        wall = sum(w for w, _ in inside)
        return sum(c for _, c in inside) / wall if len(inside) >= 2 and wall > 0 else None

    alone = share(alone_from, alone_to)
    out = []
    for start, end, cpu, _ in rounds:
        busy = share(start, end)
        host = cpu / (end - start)
        if alone is not None and busy is not None and host > 0:
            placed = min(1.0, max(0.0, (alone - busy) / host))
            out.append({"host_cores": host, "trainer_share": busy, "placement": placed})
    placement = statistics.median(r["placement"] for r in out) if out else 0.5
    return {"host_train_placement": placement, "trainer_share_alone": alone, "rounds": out}


def _next_step(steps, trainer, deadline_s: float = 600.0) -> tuple[float, float, float]:
    """The next step `measure_host_placement`'s trainer reports; a clear error if its process ends first."""
    import queue

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return steps.get(timeout=1.0)
        except queue.Empty:
            if not trainer.is_alive():
                raise RuntimeError(f"the placement's trainer process ended (exit code {trainer.exitcode})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the placement's trainer reported no step in {deadline_s:.0f} s") from None


def _busy_trainer(core: int, model_config, trainer_config: dict, pad_id: int, batch: list, stop, steps) -> None:
    """`measure_host_placement`'s trainer (a process of its own on `core`): steps on `batch` until `stop`, each
    step's (start, end, its thread's CPU seconds) into `steps`."""
    import torch

    from reference.model import build_model
    from reference.trainer.config import TrainerConfig
    from reference.trainer.trainer import Trainer

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = Trainer(build_model(model_config), TrainerConfig.from_dict(trainer_config), pad_id=pad_id)
    while not stop.is_set():
        start, cpu = time.perf_counter(), time.thread_time()
        trainer.train_step(batch)
        steps.put((start, time.perf_counter(), time.thread_time() - cpu))


def measure_sync_and_switch(model_config, repeats: int) -> dict:
    """Medians, in seconds, of the trainer publishing a version (`publish_s`: in the runtime part of a
    training step), an engine pausing, loading it and resuming (`load_s`: the weight sync) and an engine
    paused and resumed (`switch_s`: a role switch)."""
    from reference.engine.builtin import BuiltinEngine
    from reference.measure import seconds
    from reference.model import build_model
    from reference.trainer.config import TrainerConfig
    from reference.trainer.handoff import version_dir
    from reference.trainer.trainer import Trainer

    trainer = Trainer(build_model(model_config), TrainerConfig(), pad_id=0)
    times: dict[str, list[float]] = {"publish_s": [], "load_s": [], "switch_s": []}

    async def go(root: str) -> None:
        with BuiltinEngine(build_model(model_config), max_batch=8, seed=0) as engine:
            for version in range(1, repeats + 2):
                folder = f"{root}/{version}"  # a new folder each time: what a new version costs
                times["publish_s"].append(seconds(lambda f=folder: trainer.publish(f)))
                start = time.perf_counter()
                await engine.pause()
                await engine.update_weights(version, str(version_dir(folder, trainer.version)))
                await engine.resume()
                times["load_s"].append(time.perf_counter() - start)
                start = time.perf_counter()
                await engine.pause()
                await engine.resume()
                times["switch_s"].append(time.perf_counter() - start)

    with tempfile.TemporaryDirectory() as root:
        asyncio.run(go(root))
    return {k: statistics.median(v[1:]) for k, v in times.items()}  # the first of each warms up


def measure_batch_read(lengths: tuple[int, int], prompts: int, group_size: int, repeats: int) -> float:
    """Median seconds to read one step's batch (`prompts` groups of `group_size` samples of `lengths` tokens)
    from a trajectory store, as the runtime does at the start of each training step."""
    from reference.manager.store import TrajectoryStore
    from reference.measure import seconds
    from reference.rollout.groups import Episode, GroupResult, training_batch
    from reference.tasks.base import Problem

    prompt, response = lengths
    groups = []
    with tempfile.TemporaryDirectory() as root:
        store = TrajectoryStore(Path(root) / "store.sqlite")
        for g in range(prompts):
            key, samples = f"g{g}", []
            for i in range(group_size):
                rid = f"g{g}.{i}"
                store.append(
                    key,
                    rid,
                    None,
                    0,
                    list(range(prompt)),
                    [1] * response,
                    [-1.0] * response,
                    [0] * response,
                    "length",
                    "x" * response,
                )
                samples.append(Episode(key, (rid,), 1.0, True, 0, 0, response))
            store.annotate(key, {"reward": 1.0})
            groups.append(GroupResult(g, key, Problem(key, "p", "a"), tuple(samples)))
        times = [seconds(lambda: training_batch(store, groups)) for _ in range(repeats + 1)]
        store.close()
    return statistics.median(times[1:])
