"""What `experiments.validate` runs: the runtime's setup (the throughput task, or `make train-swe`'s recipe), the
simulator's config that mirrors it (the runtime's model as a config.json, its resources as one-core devices,
its engine's batch limit, its trainer's micro-batches, the workload's lengths) and where each round's runs and
parts go.
"""

from __future__ import annotations

import os
import random
import statistics
from pathlib import Path

SWE_CONFIG = Path("reference/configs/swe.yaml")  # make train-swe's recipe: what the SWE runs run


def runtime_setup(steps: int, workload: str = "math"):
    """(the runtime's train config for `--compare`, its task, its model's transformers config): the throughput
    task, or (`workload` swe) `make train-swe`'s recipe without its evaluations."""
    from reference.control.config import load_train_config
    from reference.control.layout import model_config
    from reference.tasks import make_task

    overrides = [f"policy.num_steps={steps}", "run.eval_every_steps=0"]
    if workload == "swe":
        cfg = load_train_config([SWE_CONFIG], [*overrides, "run.evaluate=false"])
    else:
        cfg = load_train_config(None, ["task.name=throughput", *overrides])
    task = make_task(cfg.task.name, **cfg.task.options)
    return cfg, task, model_config(cfg, task)


def mean_lengths(task) -> tuple[int, int]:
    """(prompt, response) tokens of the workload's mean sequence, from its length distributions (an agent's
    episode: its context, and the tokens its turns generated)."""
    from experiments.trainer_parts import draw_batch_lengths
    from sim.config import Dist
    from sim.workload import draw_int

    rng = random.Random(0)
    if task.simulator_workload().get("kind") == "swe":
        drawn = draw_batch_lengths(task, 4000, 1, rng)
        return round(statistics.fmean(p for p, _ in drawn)), round(statistics.fmean(r for _, r in drawn))
    dists = {k: Dist(**v) for k, v in task.simulator_workload().items() if k in ("prompt_tokens", "response_tokens")}
    means = [
        statistics.fmean(draw_int(dists[k], rng) for _ in range(4000)) for k in ("prompt_tokens", "response_tokens")
    ]
    return round(means[0]), round(means[1])


def config_path(path: Path) -> str:
    """A file the simulator's config names: relative to the current folder when inside it (so that the
    written sim_config.yaml runs from the repository, as `python -m sim --config ...`), else absolute."""
    path = path.resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def host_cores(rt) -> int:
    """Cores of this machine the runtime's resources leave to its other processes (the driver with the
    trajectory and rollout managers): the simulator's `cluster.host_cores`."""
    return max(0, len(os.sched_getaffinity(0)) - rt.resources.count * rt.resources.cores_per_resource)


def sim_config_dict(rt, task, steps: int, out: Path, costs: dict, measured: dict | None = None) -> dict:
    """The simulator's config for the runtime's `--compare` run (see the module docstring). `measured`: the
    workload's keys measured for this round (the SWE runs' episodes and sandboxes), over the task's own."""
    from reference.manager.manager import ManagerConfig
    from reference.trainer.config import TrainerConfig
    from sim.config import WorkloadConfig

    workload = {
        **task.simulator_workload(),
        "prompts_per_step": rt.rollout.prompts_per_step,
        "group_size": rt.rollout.group_size,
    }
    if measured:
        workload.update({k: v for k, v in measured.items() if k in WorkloadConfig.__dataclass_fields__})
    if workload.get("kind") == "swe":
        # the built-in engine keeps a finished request's whole KV (reference/engine/prefix_cache.py), and an
        # agent's next turn starts with it (it is emptied on a weight update, which the simulator does not do)
        workload["prefix_cache_hit"] = 1.0
    trainer = TrainerConfig.from_dict(dict(rt.trainer))
    return {
        "seed": rt.run.seed,
        "num_steps": steps,
        "model": config_path(out / "model" / "config.json"),
        "cluster": {
            "device": config_path(out / "cpu-core.yaml"),
            "num_gpus": rt.resources.count,
            "host_cores": host_cores(rt),
        },
        "pools": {"train_fraction": rt.resources.train_fraction},
        "rollout": {
            "tensor_parallel": rt.resources.cores_per_resource,
            "max_num_seqs": rt.engine.max_batch,
            "gpu_memory_utilization": 1.0,
            "workspace_gb": 0.0,
            "prefix_caching": True,
            # the runtime's trajectory manager routes each request to the least loaded engine, a group (one
            # session) kept on its engine within this many requests of it (reference/train.py: the default)
            "affinity_slack": ManagerConfig().affinity_slack,
            # the runtime's rollout manager runs at most this many samples, whole groups, at once
            "max_concurrency": rt.rollout.max_concurrency,
        },
        "train": {
            "recompute_logprobs": False,
            "reference_model": False,
            "activation_recompute": "none",
            "grad_bytes_per_param": 4,
            "optimizer_bytes_per_param": 8,
            # the runtime's trainer pads micro-batches of this many sequences to their longest
            "micro_batch_sequences": trainer.micro_batch_size,
            "ppo_epochs": trainer.epochs,  # optimiser steps on a step's data
            # the runs' samples whose advantage is 0, which the runtime's trainer runs forward only (round_workload)
            "zero_advantage_share": (measured or {}).get("zero_advantage_share", 0.0),
        },
        "workload": workload,
        "policy": {
            "max_staleness": rt.policy.max_staleness,
            "window_batches": rt.policy.window_batches,
            "fill_idle": rt.policy.fill_idle,
            "stale_samples": rt.policy.stale_samples,
            "drain": rt.policy.drain,
        },
        "costs": {
            "profile": config_path(out / "profile.yaml"),
            "broadcast_hop_s": 0.0,
            "nvlink_efficiency": 1.0,
            "network_efficiency": 1.0,
            "pcie_efficiency": 1.0,
            **costs,
        },
    }


def run_dir(runtime: Path, policy: str, round_: int, repeats: int) -> Path:
    """Where round `round_` (from 0) of `repeats` runs `policy`."""
    return runtime / (policy if repeats == 1 else f"{policy}-r{round_ + 1}")


def round_dir(out: Path, round_: int, repeats: int) -> Path:
    """Where round `round_`'s parts and the simulator's config for it go: `out` itself for a single round."""
    return out if repeats == 1 else out / f"round-{round_ + 1}"
