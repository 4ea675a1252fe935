"""`python -m reference train`: GRPO post-training on real engines and trainer shards, scheduled by a `core` policy.

The story: lay out the resources the policy wants (capability tags), write the initial weights (warm-started
on the task's demonstrations where the config asks: `control/warm_start.py`), start one worker per resource on
Ray (its own cores, its engine, its trainer shard), put the trajectory manager in front of the engines, and
let `core.driver` run the policy against the runtime executor until the last step; then score the timeline
with the simulator's scorer and write the same outputs.
"""

from __future__ import annotations

import dataclasses
import secrets
from contextlib import contextmanager
from pathlib import Path

from core.policies import make_policy
from core.tags import Tag
from core.timeline import Timeline, TimelineRecorder
from reference.control.config import TrainConfig, check_feasible, policy_config, trainer_settings
from reference.control.engines import WorkerEngine
from reference.control.layout import (
    initial_weights,
    last_checkpoint,
    resumed,
    resumed_weights,
    ships_initial_weights,
    worker_specs,
)
from reference.control.report import MetricsLog, Progress
from reference.control.run import RunHandles, RunPlan, RunSinks, run_policy
from reference.control.warm_start import warm_start
from reference.control.worker import ResourceWorker
from reference.engine.client import HTTPEngine
from reference.manager.embedded import ManagerThread
from reference.manager.manager import ManagerConfig
from reference.tasks import make_task
from reference.tokenizer import Tokenizer


def train(
    cfg: TrainConfig, out: Path, workers_factory=None, progress: bool = True, resume: bool = False
) -> tuple[Timeline, MetricsLog]:
    """Run `cfg` to its last step; returns the timeline and the per-step metrics (also written in `out`).
    `resume`: continue the run in `out` from its last checkpoint (the steps after it are trained again)."""
    check_feasible(cfg)
    task = make_task(cfg.task.name, **cfg.task.options)
    try:
        return _train(cfg, task, out, workers_factory, progress, resume)
    finally:
        _close(task)


@contextmanager
def _closing_first(task):
    """On a stop (Ctrl-C, an error), close the task while the manager still answers: its episodes then end at
    their next command (their sandboxes gone), not after their agents have retried a manager that has gone."""
    try:
        yield
    except BaseException:
        _close(task)
        raise


def _close(task) -> None:
    if (close := getattr(task, "close", None)) is not None:  # a task that holds sandboxes or threads (idempotent)
        close()


def _train(
    cfg: TrainConfig, task, out: Path, workers_factory, progress: bool, resume: bool
) -> tuple[Timeline, MetricsLog]:
    checkpoint = last_checkpoint(out, cfg.policy.num_steps) if resume else None
    done = checkpoint.step if checkpoint else 0  # steps trained before this run: the policy counts from here
    pcfg = policy_config(cfg, cfg.policy.num_steps - done)
    policy = make_policy(cfg.policy.name, pcfg, cfg.resources.count, cfg.resources.train_fraction, 1)
    weights = out / "weights"
    model_dir = resumed_weights(cfg, task, weights, checkpoint) if checkpoint else initial_weights(cfg, task, weights)
    metrics = MetricsLog(out / "metrics.jsonl", append=resume)
    if cfg.warm_start.get("steps", 0) and not checkpoint:  # supervised on demonstrations first, where asked
        model_dir = warm_start(cfg, task, out, model_dir, metrics, progress)
    specs = worker_specs(cfg, policy, model_dir)
    if workers_factory is None:
        from reference.ray.workers import RayWorkers as workers_factory
    admin = secrets.token_urlsafe(24)  # the manager's admin token: rewards and weights are ours alone
    tokenizer = Tokenizer.load(model_dir)  # the model's own (a fresh model's is the task's)
    # object_store: weights the run wrote here go to each worker, which starts from its own copy
    shipped = {"initial_weights": model_dir} if ships_initial_weights(cfg, model_dir) else {}
    with workers_factory(specs, cfg.run.ray_address, **shipped) as workers:
        addresses = {s.name: workers.get(s.name, ResourceWorker.engine_address) for s in specs if s.can_roll_out}
        engines = {name: HTTPEngine(url, token=token) for name, (url, token) in addresses.items()}
        local = cfg.run.ray_address is None
        pids = {n: workers.get(n, ResourceWorker.engine_pid) for n in engines}
        owned = {n: WorkerEngine(workers, n, engines[n].base_url, pids[n], local) for n in engines}
        # The rollout manager bounds the requests in flight itself, so the manager sheds nothing here.
        config = ManagerConfig(
            model_name=f"seamlessflow-{cfg.task.name}",
            admin_token=admin,
            max_pause_s=0,
            max_in_flight_requests=0,
            max_loop_lag_s=0,
        )
        with (
            ManagerThread(engines, tokenizer, out / "trajectories.sqlite", config, processes=owned) as m,
            _closing_first(task),
        ):
            for name in engines:  # a resource that starts on its train tag takes no request
                m.call_soon(m.manager.set_serving, name, policy.initial_active(name) is Tag.ROLLOUT)
            start_from = str(checkpoint.path) if checkpoint else None
            workers.init_trainers(
                policy.trainers,
                trainer_settings(cfg),
                str(out / "checkpoints"),
                start_from,
                dataclasses.asdict(cfg.trainer_parallel),
            )
            adopted = []
            if checkpoint:  # every engine from the checkpoint's version: model_dir, or each worker's own copy of it
                own_copies = {n: workers.get(n, ResourceWorker.model_dir) for n in engines}
                adopted = m.call(resumed(m.manager, done, own_copies))
            active = {n: policy.initial_active(n).value for n in policy.resources}
            recorder = TimelineRecorder(list(policy.resources.values()), active)
            with Progress(cfg.policy.num_steps, enabled=progress, done=done) as bar:
                run = run_policy(
                    plan=RunPlan(cfg, task, out, offset=done, adopted=tuple(adopted)),
                    live=RunHandles(policy, workers, m, admin),
                    sinks=RunSinks(recorder, metrics, bar),
                )
                wall = m.call(run, timeout_s=cfg.run.time_limit_s + 120)
    meta = {
        "policy": policy.name,
        "model": cfg.model.dir or "tiny",
        "device": "cpu",
        "num_gpus": cfg.resources.count,
        "workload": cfg.task.name,
        "seed": cfg.run.seed,
        "clock": "measured",
        "clock_zero_epoch_s": metrics.clock_zero_epoch_s,
    }
    return recorder.finish(wall, meta, metrics.counters), metrics
