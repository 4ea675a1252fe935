"""Before RL: evaluate the initial weights, then a supervised warm start on the task's demonstrations.

With `warm_start.steps > 0` (`reference.trainer.supervised.SupervisedConfig`'s fields), `train` first
measures the fresh weights if `warm_start.evaluate_before` (pass@1 on the held-out and, where the task lists
them, the train problems: one engine process and an embedded trajectory manager, the same episodes as the
run's evaluations; off by default: a random model fills every turn to the token limit until its context is
full, which costs minutes on a CPU and always scores 0), then asks the task for its demonstrations as
training records (`task.demonstrations(dir)`: a SWE task replays them through a manager in its sandboxes, so
they hold exactly what a rollout would), fits the weights on them in this process (`supervised_fit`, a
progress bar per step) and publishes the result as version 0: the RL run starts from it and evaluates it
again as its `start`. Both evaluations and every warm-start step go to metrics.jsonl (`kind`: `held_out`
with `label: init`, and `warm_start`).

This runs before the run's workers start, so it has every core of the machine to itself.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

from core.errors import UserError
from core.outputs import show_progress
from reference.control.report import MetricsLog
from reference.engine.process import EngineProcess, EngineSpec
from reference.manager.embedded import ManagerThread
from reference.manager.manager import ManagerConfig
from reference.model import load_checkpoint
from reference.rollout.groups import RolloutConfig, RolloutManager
from reference.tokenizer import Tokenizer
from reference.trainer.handoff import publish_weights
from reference.trainer.supervised import SupervisedConfig, supervised_fit


def warm_start(cfg, task, out: Path, model_dir: str, metrics: MetricsLog, progress: bool = True) -> str:
    """Evaluate `model_dir`, fit it on the task's demonstrations, publish it as version 0 under out/weights;
    returns the directory of the warm weights."""
    demonstrations = getattr(task, "demonstrations", None)
    if demonstrations is None:
        raise UserError(f"task {cfg.task.name!r} has no demonstrations for a warm start; set warm_start.steps=0")
    config = SupervisedConfig.from_section(cfg.warm_start)
    start = time.monotonic()
    if cfg.warm_start.get("evaluate_before", False):
        before = evaluate_weights(cfg, task, model_dir, out / "trajectories.sqlite", "init")
        metrics.held_out(0, {**before, "label": "init", "time_s": 0.0})
    records = demonstrations(out / "demonstrations")
    model, tokenizer = load_checkpoint(model_dir)
    bar = tqdm(total=config.steps, desc="warm start", unit="step", disable=not show_progress(progress), leave=False)

    every = max(1, config.steps // 10)  # without a terminal: a plain line every tenth of the warm start

    def on_step(record: dict) -> None:
        metrics.warm_start({**record, "time_s": time.monotonic() - start})
        bar.set_postfix(loss=f"{record['loss']:.3f}")
        bar.update(1)
        if progress and bar.disable and (record["step"] % every == 0 or record["step"] == config.steps):
            print(
                f"warm start: step {record['step']}/{config.steps}, loss {record['loss']:.4f}",
                file=sys.stderr,
                flush=True,
            )

    try:
        steps = supervised_fit(model, records, config, tokenizer.pad_token_id, on_step)
    finally:
        bar.close()
    window = steps[-config.target_window :]
    window_loss = sum(r["loss"] for r in window) / len(window)
    reached = len(steps) < config.steps  # stopped at warm_start.target_loss
    if reached and progress:
        print(
            f"warm start: stopped at step {len(steps)}/{config.steps}: mean loss of the last {len(window)} steps "
            f"{window_loss:.4f} <= target {config.target_loss}",
            file=sys.stderr,
            flush=True,
        )
    handoff = publish_weights(model.state_dict(), model.config, out / "weights", 0, tokenizer)
    metrics.counters.update(
        warm_start_s=time.monotonic() - start,
        warm_start_records=len(records),
        warm_start_loss_window=window_loss,
        warm_start_reached_target=float(reached),
    )
    return str(handoff.path.resolve())


def evaluate_weights(cfg, task, model_dir: str, store: Path, label: str) -> dict:
    """`run.eval_samples` episodes of every evaluation problem of `task` (`run.held_out_samples` of a held-out one)
    with the weights in `model_dir`, through one engine process of the run's backend and an embedded trajectory
    manager recording to `store`."""
    from reference.control.run import evaluate_splits

    spec = EngineSpec(
        backend=cfg.engine.backend,
        model=model_dir,
        seed=cfg.run.seed,
        max_batch=cfg.engine.max_batch,
        coalesce_s=cfg.engine.coalesce_s,
        logprobs_mode=cfg.engine.logprobs_mode,
    )
    rollout_config = RolloutConfig(cfg.rollout.group_size, cfg.rollout.max_concurrency, cfg.rollout.temperature)
    config = ManagerConfig(
        model_name=f"seamlessflow-{cfg.task.name}", max_pause_s=0, max_in_flight_requests=0, max_loop_lag_s=0
    )

    async def run(url: str) -> dict:
        async with RolloutManager(
            task, url, rollout_config, f"{label}{time.time_ns()}", cfg.run.seed, lambda group: None
        ) as rollout:
            return await evaluate_splits(rollout, task, label, cfg.run.eval_samples, cfg.run.held_out_samples)

    tokenizer = Tokenizer.load(model_dir)
    with EngineProcess(spec) as engine, ManagerThread({"eval": engine.client()}, tokenizer, store, config) as m:
        return m.call(run(m.url), timeout_s=cfg.run.time_limit_s)
