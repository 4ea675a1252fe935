"""Does the simulator predict the runtime? (`make validate`)

The runtime (`reference/`) and the simulator (`sim/`) run the same `core/policies` objects; this asks
whether, given the costs of the runtime's parts measured one by one on this machine, the simulator
predicts what the whole runtime does. Three stages:

1. **Parts, measured alone** (no whole run is used to tune anything), each on one core with one torch
   thread, as one runtime resource has:
   - the device: an fp32 matmul's FLOP/s (the best of several 1024 x 1024 products) and a memory
     copy's bandwidth, written as a device file (`cpu-core.yaml`);
   - the built-in engine as the runtime deploys it (a process of its own on one core, called over HTTP
     from another): decode steps of `batch` sequences at `context` tokens (the engine's own seconds a
     decode step, from its stats) and prefills of one prompt, written as a profile (sim/profile.py) from
     which sim/calibration.py fits the decode and prefill constants (efficiencies, the step's and each
     sequence's decode overhead, a prefill's fixed cost);
   - the GRPO trainer (`Trainer.train_step`, the runtime's own): steps on batches drawn from the
     workload (groups sharing a length, as the runtime's), three at each of three sizes, and on batches
     of one length each (short, middling and long, at one token count: they tell attention, which grows
     with the length, from the matmuls, which do not), each the median of three steps, each step right
     after the trainer published its weights, as in a run; `train_mfu`,
     `train_attention_mfu` and `train_step_overhead_s` are fitted to them in the simulator's own cost
     terms (sim/train_layout.py, its micro-batches padded as the trainer's: `train.micro_batch_sequences`),
     and the overhead also gets the time to read a step's batch from a trajectory store; and the same
     trainer on the runtime's data-parallel layout (a gloo rank a core, whole groups balanced by tokens,
     the step waiting for its slowest rank), as `colocated` trains;
   - the host's work a generated token (`costs.host_token_s`): the runtime's trajectory and rollout
     managers in this process, on the other core, feeding one engine the workload's groups; this process's
     CPU time over the tokens. The simulator runs with `cluster.host_cores` = the cores the resources leave
     free (0 here), so that work takes cores from busy resources when none is idle (sim/host.py);
   - where that work runs when a rollout core and a training core are both busy
     (`costs.host_train_placement`): the same managers, free to run on either core as the runtime's driver
     is, feeding an engine on one core while a trainer steps without pause on the other; the share of its
     core the trainer loses, over the host's CPU (`measure_host_placement`);
   - a weight sync: the trainer publishing a version goes into `train_step_overhead_s` (the runtime
     publishes inside its training step); the engine, in its own process behind the trajectory manager,
     synced through the manager's calls as the executor syncs it (pause, restart what is too old, load,
     resume): with nothing generating, `sync_fixed_s`; what a sync takes beyond that while the engine
     generates for the run's rollout manager, `sync_busy_s` (`measure_sync_in_place`); a role switch (an
     engine paused and resumed) is `switch_fixed_s`.
2. **The whole runtime**: `python -m reference train` on the throughput workload for each policy, `--steps`
   steps each, as `make compare-train` runs them, `--repeats` times (3), round by round (every policy once,
   then again), so each measurement is a mean with the runtime's own spread beside it. Each round measures
   its parts (stage 1) just before its runs: this machine's speed drifts by a tenth or more over minutes,
   so parts measured once at the start would stand for a slower or faster machine by the last round.
3. **The simulator**, for each round, on a config that mirrors the runtime's (the runtime's model as a
   config.json, two resources of one core, the throughput task's length distributions, the engine's batch
   limit, no logprob recompute, no activation recompute) with the costs that round's parts give.

Printed and written: per policy, measured (the mean of the repeats, and their range) against predicted
(the mean of the rounds' predictions) trained tokens/s, step time, bubble and the shares of device time in
rollout, training and sync, with the relative error, and the ratio to colocated of each; the mean and
largest error over the policies beside the runtime's own spread, and the policies ordered by throughput on
both sides; each round's own errors and order (its prediction against its runs); and the CPU-seconds each
runtime run's processes used, by role, with the cores they kept busy while engines generated
(`CpuSampler`), while engines generate and while only trainers work. What the simulator leaves out
shows up here as error: the driver's work that is not a token's (the policy, Ray calls, the timeline's
sampling) and the run's start.

    python -m experiments.validate [--steps 10] [--repeats 3] [--policies all] [--out DIR] [--overwrite] [--quick]

Writes, in `--out` (default experiments/out/validate): validate.json (each round's measured parts, both
sides' summaries and the errors), round-<n>/ (each round's cpu-core.yaml, model/config.json, profile.yaml and
sim_config.yaml: what the simulator ran for it; in `--out` itself with `--repeats 1`), runtime/ (the
runtime's outputs) and validate.png.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from core.errors import UserError
from core.outputs import prepare_out
from experiments._common import NO_STAMP, save_json, source_fingerprint
from experiments.runtime_parts import (
    DEVICE_NAME,
    FULL,
    QUICK,
    Grid,
    fit_data_parallel,
    fit_trainer,
    measure_batch_read,
    measure_data_parallel,
    measure_device,
    measure_engine,
    measure_host,
    measure_host_placement,
    measure_sync_and_switch,
    measure_sync_in_place,
    measure_trainer,
    one_core,
)

POLICIES = ("colocated", "disaggregated", "async", "tag", "streaming")
WORKLOADS = ("math", "swe")
DEFAULT_OUT = Path("experiments/out/validate")
DEFAULT_OUTS = {"math": DEFAULT_OUT, "swe": Path("experiments/out/validate-swe")}
DEFAULT_STEPS = {"math": 10, "swe": 3}
SWE_CONFIG = Path("reference/configs/swe.yaml")  # make train-swe's recipe: what the SWE runs run
# The SWE workload's parts: decode at its episodes' contexts (a prompt of about 770 tokens, episodes of 1,700-
# 2,300), its turns' prefills, the trainer on a step's 32 episodes (and halves), a step's 8 groups (and halves)
# feeding the host's parts.
# A sync while generating every 5 s: an engine re-prefills its requests' contexts after each (a few seconds at 16
# episodes of 2,000 tokens on one core), so syncs every 0.25 s, as for math, would leave it nothing but prefills.
SWE_FULL = Grid((1, 8, 32), (256, 1024, 2048), 16, (64, 256, 1024, 2048), (16, 32), 2, 4, 16384, 1, 5.0)
SWE_QUICK = Grid((1, 8), (256, 1024), 8, (64, 512), (4, 8), 1, 2, 4096, 1, 5.0)
PHASES = ("rollout", "train", "sync", "idle")  # device time, per step, in both summaries' utilisation


def per_step_s(summary: dict, phase: str) -> float:
    """Device-seconds a step spends in `phase` (over every resource)."""
    total = summary["device_seconds"]["total"]
    return summary["utilisation"].get(phase, 0.0) * total / max(1, summary["num_steps"])


# Compared: (label, value of a summary, format, error kind: relative or percentage points).
METRICS = (
    ("trained tok/s", lambda s: s["token_throughput"], "{:,.0f}", "relative"),
    ("step (s)", lambda s: s["step_time_s"]["mean"], "{:.2f}", "relative"),
    ("bubble", lambda s: s["bubble_fraction"], "{:.1%}", "points"),
    *((f"{phase} dev-s/step", lambda s, p=phase: per_step_s(s, p), "{:.2f}", "relative") for phase in PHASES),
)


# ---- what the runtime runs, and the simulator's mirror of it ----


def runtime_setup(steps: int, workload: str = "math"):
    """(the runtime's train config for `--compare`, its task, its model's transformers config): the throughput
    task, or (`workload` swe) `make train-swe`'s recipe without its evaluations."""
    from reference.control.config import load_train_config
    from reference.control.layout import task_context
    from reference.model import tiny_config
    from reference.tasks import make_task

    overrides = [f"policy.num_steps={steps}", "run.eval_every_steps=0"]
    if workload == "swe":
        cfg = load_train_config([SWE_CONFIG], [*overrides, "run.evaluate=false"])
    else:
        cfg = load_train_config(None, ["task.name=throughput", *overrides])
    task = make_task(cfg.task.name, **cfg.task.options)
    m = cfg.model
    model_config = tiny_config(
        task.tokenizer.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=task_context(task),
    )
    return cfg, task, model_config


def mean_lengths(task) -> tuple[int, int]:
    """(prompt, response) tokens of the workload's mean sequence, from its length distributions (an agent's
    episode: its context, and the tokens its turns generated)."""
    from experiments.runtime_parts import draw_batch_lengths
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


# ---- stages 2 and 3 ----


def run_round(
    steps: int,
    policies: tuple[str, ...],
    out: Path,
    round_: int,
    repeats: int,
    task_args: tuple[str, ...] = ("--task", "throughput"),
) -> tuple[dict, dict]:
    """Round `round_` (from 0) of `repeats`: one `python -m reference train` per policy (and `task_args`), as
    `train --compare` runs them, into `out`/<policy> (one round) or `out`/<policy>-r<round> (several): each
    policy's summary, and the CPU its processes used (`CpuSampler`)."""
    import json

    summaries, cpu = {}, {}
    for policy in policies:
        where = run_dir(out, policy, round_, repeats)
        argv = [
            sys.executable,
            "-m",
            "reference",
            "train",
            *task_args,
            "--policy",
            policy,
            "--steps",
            str(steps),
            "--set",
            "run.eval_every_steps=0",
            "--out",
            str(where),
            "--quiet",
        ]
        print(f"runtime: {policy}, {steps} steps (round {round_ + 1} of {repeats}) ...", flush=True)
        with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
            sampler = CpuSampler(proc.pid)
            stderr = sampler.follow(proc)
        if proc.returncode != 0:
            raise RuntimeError(f"the runtime's {policy} run failed ({proc.returncode}):\n{stderr[-2000:]}")
        summaries[policy] = json.loads((where / "summary.json").read_text())
        generating = sampler.while_generating(where / "intervals.json")
        training = sampler.while_training_only(where / "intervals.json")
        cpu[policy] = {**sampler.result(), "while_generating": generating, "while_training_only": training}
    return summaries, cpu


def run_dir(runtime: Path, policy: str, round_: int, repeats: int) -> Path:
    """Where round `round_` (from 0) of `repeats` runs `policy`."""
    return runtime / (policy if repeats == 1 else f"{policy}-r{round_ + 1}")


def round_dir(out: Path, round_: int, repeats: int) -> Path:
    """Where round `round_`'s parts and the simulator's config for it go: `out` itself for a single round."""
    return out if repeats == 1 else out / f"round-{round_ + 1}"


DOCKER_COMMANDS = ("dockerd", "containerd", "runc", "docker-init", "docker-proxy")


def docker_processes(processes: dict[int, tuple[int, float, str]]) -> dict[int, float]:
    """Of `processes` (pid -> (parent, CPU-seconds, command name)), the Docker daemon's (dockerd, containerd and
    its shims, runc) and everything that descends from a shim (the containers' processes): pid -> CPU-seconds."""
    out = {pid: cpu for pid, (_, cpu, comm) in processes.items() if comm.startswith(DOCKER_COMMANDS)}
    shims = {pid for pid, (_, _, comm) in processes.items() if comm.startswith("containerd-shim")}
    for pid in sorted(processes):  # parents have lower pids except after a wrap: walk up instead
        parent, seen = processes[pid][0], 0
        while parent in processes and parent not in shims and seen < 64:
            parent, seen = processes[parent][0], seen + 1
        if parent in shims:
            out[pid] = processes[pid][1]
    return out


def docker_cpu_s() -> float:
    """CPU-seconds the Docker daemon's processes and the containers' have used so far (`docker_processes`)."""
    tick, processes = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            processes[int(entry)] = (
                int(fields[1]),
                (int(fields[11]) + int(fields[12])) / tick,
                stat[stat.index("(") + 1 : stat.rindex(")")],
            )
    return sum(docker_processes(processes).values())


class CpuSampler:
    """CPU-seconds of a run's processes by role, read from /proc every `every_s` while it runs (the
    reads cost about 1% of a core): the run's own process (the driver, with the trajectory and rollout
    managers), its engine processes, Ray's workers (the resources' trainers) and everything else it
    started, and the Docker daemon's processes with the sandboxes' containers (`docker`: what the daemon used
    before the run's first read is left out). A process that ends between two reads loses what it used since
    the last."""

    ROLES = ("driver", "engines", "ray workers", "other", "docker")

    def __init__(self, root: int, every_s: float = 0.25) -> None:
        self.root, self.every_s = root, every_s
        self._seen: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU-seconds at the last read)
        self._base: dict[int, float] = {}  # docker processes already running at the first read: their CPU then
        self._series: list[tuple[float, dict[str, float]]] = []  # (Unix time, CPU-seconds by role) of each read
        self._tick = os.sysconf("SC_CLK_TCK")
        self._wall_s = 0.0

    def follow(self, proc: subprocess.Popen) -> str:
        """Read until `proc` ends; its standard error."""
        import threading

        err: list[str] = []
        reader = threading.Thread(target=lambda: err.append(proc.stderr.read() if proc.stderr else ""), daemon=True)
        reader.start()
        started = time.perf_counter()
        while proc.poll() is None:
            self._read()
            time.sleep(self.every_s)
        self._wall_s = time.perf_counter() - started
        reader.join()
        return "".join(err)

    def _read(self) -> None:
        first = not self._series
        docker: dict[int, tuple[int, float, str]] = {}  # other processes: pid -> (parent, CPU-seconds, name)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / self._tick
            if pid != self.root and pid not in self._seen and not self._descends(int(fields[1])):
                docker[pid] = (int(fields[1]), cpu, stat[stat.index("(") + 1 : stat.rindex(")")])
                continue
            role = self._role(pid, stat, cmdline)
            if pid in self._seen and role == "other":  # an ending process's cmdline reads empty: keep its role
                role = self._seen[pid][0]
            self._seen[pid] = (role, cpu - self._base.get(pid, 0.0))  # (a docker process's CPU before the run out)
        for pid, cpu in docker_processes(docker).items():
            if first:
                self._base[pid] = cpu
            self._seen[pid] = ("docker", cpu - self._base.get(pid, 0.0))
        self._series.append((time.time(), self._by_role()))

    def _by_role(self) -> dict[str, float]:
        by_role = dict.fromkeys(self.ROLES, 0.0)
        for role, cpu in self._seen.values():
            by_role[role] += cpu
        return by_role

    def _descends(self, parent: int) -> bool:
        return parent == self.root or parent in self._seen

    def _role(self, pid: int, stat: str, cmdline: str) -> str:
        if pid == self.root:
            return "driver"
        if " -m reference engine" in cmdline:
            return "engines"
        if stat[stat.index("(") + 1 :].startswith("ray::") or cmdline.startswith("ray::"):
            return "ray workers"
        return "other"

    def result(self) -> dict:
        by_role = self._by_role()
        return {"wall_s": round(self._wall_s, 2), "cpu_s": {k: round(v, 2) for k, v in by_role.items()}}

    def while_generating(self, timeline: Path) -> dict | None:
        """Cores each role kept busy, on average, over the reads whose midpoint falls while some resource
        is in a rollout phase of the run's timeline, and the seconds those reads cover; None when the
        timeline does not give its clock's zero as a Unix time (`clock_zero_epoch_s`)."""
        from core.tags import Phase

        return self.while_phase(timeline, Phase.ROLLOUT, exclusive=False)

    def while_training_only(self, timeline: Path) -> dict | None:
        """As `while_generating`, over the reads while some resource trains and none generates: what takes
        cores from the trainers when no engine has work."""
        from core.tags import Phase

        return self.while_phase(timeline, Phase.TRAIN, exclusive=True)

    def while_phase(self, timeline: Path, phase, exclusive: bool) -> dict | None:
        """Cores each role kept busy over the reads whose midpoint falls in a `phase` interval of some
        resource (with `exclusive`, and in no other resource's rollout or train interval of another phase)."""
        from core.tags import Phase
        from core.timeline import Timeline

        if not timeline.is_file():
            return None
        run = Timeline.load(timeline)
        zero = run.meta.get("clock_zero_epoch_s")
        if zero is None or len(self._series) < 2:
            return None
        spans = [(i.start_s + zero, i.end_s + zero) for i in run.intervals if i.phase is phase]
        others = [
            (i.start_s + zero, i.end_s + zero)
            for i in run.intervals
            if exclusive and i.phase is not phase and i.phase in (Phase.ROLLOUT, Phase.TRAIN)
        ]
        seconds, cpu = 0.0, dict.fromkeys(self.ROLES, 0.0)
        for (t0, c0), (t1, c1) in zip(self._series, self._series[1:], strict=False):
            middle = (t0 + t1) / 2
            inside = any(start <= middle < end for start, end in spans)
            if inside and not any(start <= middle < end for start, end in others):
                seconds += t1 - t0
                for role in self.ROLES:
                    cpu[role] += c1[role] - c0[role]
        cores = {role: round(cpu[role] / seconds, 2) if seconds else None for role in self.ROLES}
        return {"seconds": round(seconds, 2), "cores": cores}


def run_sim(config_path: Path, policies: tuple[str, ...]) -> tuple[dict[str, dict], dict | None]:
    """Each policy's simulated summary, and what the profile calibrated (sim/calibration.py)."""
    from core import specs
    from core.metrics import summarize
    from sim.calibration import calibrate
    from sim.config import load_config
    from sim.runner import simulate

    cfg = load_config(config_path)
    calibration = calibrate(cfg, specs.model(cfg.model), specs.device(cfg.cluster.device))
    return {p: summarize(simulate(cfg, p)) for p in policies}, (calibration.to_dict() if calibration else None)


# ---- the comparison ----


def runs_of(measured: dict | list) -> list[dict]:
    """A policy's measured summaries: a list of repeats, or one summary (an older validate.json)."""
    return list(measured) if isinstance(measured, list) else [measured]


def compare(measured: dict[str, dict | list[dict]], predicted: dict[str, dict | list[dict]]) -> dict[str, dict]:
    """Per policy and metric: the measured mean over the runtime's repeats with their range (`low`, `high`)
    and `spread` (half the range, relative to the mean; in points for shares), the prediction (the mean of
    the rounds' when each round was predicted from its own parts), and the error against the mean (relative
    for rates and times, in percentage points for shares), with each round's own error beside it
    (`round_errors`: its prediction against its run) when there is a prediction a round; ratios to colocated
    when it ran."""
    rows = {}
    for policy in measured:
        runs, guesses = runs_of(measured[policy]), runs_of(predicted[policy])
        row = {}
        for label, get, _, kind in METRICS:
            values = [get(r) for r in runs]
            guessed = [get(g) for g in guesses]
            m, p = statistics.fmean(values), statistics.fmean(guessed)
            half = (max(values) - min(values)) / 2
            spread = half if kind == "points" else (half / m if m else math.nan)
            row[label] = {
                "measured": m,
                "low": min(values),
                "high": max(values),
                "spread": spread,
                "runs": len(runs),
                "predicted": p,
                "error": _error(p, m, kind),
                "error_kind": kind,
            }
            if len(guesses) == len(runs) > 1:
                row[label]["round_predicted"] = guessed
                row[label]["round_errors"] = [_error(g, v, kind) for g, v in zip(guessed, values, strict=True)]
                row[label]["round_measured"] = values
        rows[policy] = row
    if "colocated" in measured:
        base = rows["colocated"]["trained tok/s"]
        for row in rows.values():
            row["ratio to colocated"] = {
                "measured": row["trained tok/s"]["measured"] / base["measured"],
                "predicted": row["trained tok/s"]["predicted"] / base["predicted"],
            }
    return rows


def _error(predicted: float, measured: float, kind: str) -> float:
    if kind == "points":
        return predicted - measured
    return predicted / measured - 1 if measured else math.nan


def agreement(rows: dict[str, dict]) -> dict:
    """How well the prediction agrees over the policies: the mean and the largest absolute error of
    throughput and of step time, the runtime's own largest spread beside them, and the policies ordered by
    throughput on each side; with a prediction a round, the same for each round alone (`rounds`: its mean
    and largest errors, and whether its order is its run's)."""
    out: dict = {}
    for label in ("trained tok/s", "step (s)"):
        errors = [abs(row[label]["error"]) for row in rows.values()]
        out[label] = {
            "mean_abs_error": statistics.fmean(errors),
            "max_abs_error": max(errors),
            "largest_spread": max(row[label]["spread"] for row in rows.values()),
        }
    for side in ("measured", "predicted"):
        out[f"order_{side}"] = sorted(rows, key=lambda p: -rows[p]["trained tok/s"][side])
    out["same_order"] = out["order_measured"] == out["order_predicted"]
    out["separated_pairs"] = separated_pairs(rows)
    if all("round_errors" in row["trained tok/s"] for row in rows.values()):
        count = len(next(iter(rows.values()))["trained tok/s"]["round_errors"])
        out["rounds"] = []
        for i in range(count):
            entry = {}
            for label in ("trained tok/s", "step (s)"):
                errors = [abs(row[label]["round_errors"][i]) for row in rows.values()]
                entry[label] = {"mean_abs_error": statistics.fmean(errors), "max_abs_error": max(errors)}
            for side in ("measured", "predicted"):
                entry[f"order_{side}"] = sorted(rows, key=lambda p, k=f"round_{side}": -rows[p]["trained tok/s"][k][i])
            entry["same_order"] = entry["order_measured"] == entry["order_predicted"]
            out["rounds"].append(entry)
    return out


def separated_pairs(rows: dict[str, dict]) -> list[dict]:
    """The pairs of policies the runtime's own runs tell apart by throughput: the faster one's slowest run above
    the slower one's fastest (with one run each, every pair); each with whether the simulator puts them in the
    same order (`same`). Pairs whose runs overlap have no measured order to agree with."""
    pairs = []
    for a, b in itertools.combinations(rows, 2):
        x, y = rows[a]["trained tok/s"], rows[b]["trained tok/s"]
        faster, slower = (a, b) if x["measured"] >= y["measured"] else (b, a)
        f, s = rows[faster]["trained tok/s"], rows[slower]["trained tok/s"]
        if f.get("low", f["measured"]) > s.get("high", s["measured"]):
            pairs.append({"faster": faster, "slower": slower, "same": f["predicted"] > s["predicted"]})
    return pairs


def cpu_table(cpu: dict[str, dict], cores: int) -> str:
    """CPU-seconds of each runtime run's processes by role, and the share of the machine's cores used."""
    roles = CpuSampler.ROLES
    lines = [
        f"runtime CPU-seconds by process ({cores} cores): {'policy':<14} "
        + " ".join(f"{r:>12}" for r in roles)
        + f" {'wall s':>8} {'cores used':>10}"
    ]
    for policy, row in cpu.items():
        total = sum(row["cpu_s"].values())
        used = total / row["wall_s"] if row["wall_s"] else math.nan
        lines.append(
            f"{'':<37} {policy:<14} "
            + " ".join(f"{row['cpu_s'][r]:12.1f}" for r in roles)
            + f" {row['wall_s']:8.1f} {used:10.2f}"
        )
    for key, title in (
        ("while_generating", "cores busy while engines generate:      "),
        ("while_training_only", "cores busy while only trainers work:    "),
    ):
        spans = {p: row[key] for p, row in cpu.items() if row.get(key) and row[key]["seconds"]}
        if not spans:
            continue
        lines.append(f"{title}  {'policy':<14} " + " ".join(f"{r:>12}" for r in roles) + f" {'seconds':>8} {'all':>10}")
        for policy, row in spans.items():
            cores = row["cores"]
            total = sum(v for v in cores.values() if v is not None)
            lines.append(
                f"{'':<41} {policy:<14} "
                + " ".join(f"{(cores[r] or 0):12.2f}" for r in roles)
                + f" {row['seconds']:8.1f} {total:10.2f}"
            )
    return "\n".join(lines)


def table(rows: dict[str, dict]) -> str:
    lines = [f"{'policy':<14} {'metric':<19} {'measured':>10} {'range (runs)':>24} {'simulated':>10} {'error':>8}"]
    formats = {label: fmt for label, _, fmt, _ in METRICS}
    for policy, row in sorted(rows.items(), key=lambda item: POLICIES.index(item[0])):
        for label, cell in row.items():
            fmt = formats.get(label, "{:.2f}x")
            err = cell.get("error")
            shown = "" if err is None else (f"{100 * err:+.1f} pt" if cell["error_kind"] == "points" else f"{err:+.0%}")
            spread = ""
            if "low" in cell:
                spread = f"{fmt.format(cell['low'])}-{fmt.format(cell['high'])} ({cell['runs']})"
            lines.append(
                f"{policy:<14} {label:<19} {fmt.format(cell['measured']):>10} {spread:>24} "
                f"{fmt.format(cell['predicted']):>10} {shown:>8}"
            )
            policy = ""
    return "\n".join(lines)


def agreement_text(agree: dict) -> str:
    lines = []
    for label in ("trained tok/s", "step (s)"):
        a = agree[label]
        lines.append(
            f"{label}: mean |error| {a['mean_abs_error']:.0%}, largest {a['max_abs_error']:.0%} "
            f"(the runtime's own spread: up to +-{a['largest_spread']:.0%})"
        )
    same = "the same" if agree["same_order"] else "a different"
    lines.append(f"by throughput, measured: {' > '.join(agree['order_measured'])}")
    lines.append(f"by throughput, simulated: {' > '.join(agree['order_predicted'])} ({same} order)")
    if "separated_pairs" in agree:  # (validate.json files written before it have none)
        pairs, n = agree["separated_pairs"], len(agree["order_measured"])
        wrong = [f"{p['faster']} > {p['slower']}" for p in pairs if not p["same"]]
        lines.append(
            f"pairs the runtime's runs tell apart (one's slowest run above the other's fastest): {len(pairs)} "
            f"of {n * (n - 1) // 2}; the simulator orders {len(pairs) - len(wrong)} of them the same"
            + (f" (not: {', '.join(wrong)})" if wrong else "")
        )
    for i, entry in enumerate(agree.get("rounds", [])):
        cells = [
            f"{label} mean |error| {entry[label]['mean_abs_error']:.0%}, largest {entry[label]['max_abs_error']:.0%}"
            for label in ("trained tok/s", "step (s)")
        ]
        same = "the same order" if entry["same_order"] else f"order {' > '.join(entry['order_predicted'])}"
        lines.append(f"round {i + 1} (its own parts and runs): " + "; ".join(cells) + f"; {same}")
    return "\n".join(lines)


def draw(rows: dict[str, dict], path: Path, note: str) -> None:
    """Measured against simulated, per policy: trained tokens/s, and how each policy spends device time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [p for p in POLICIES if p in rows]
    x = np.arange(len(policies))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for k, (side, colour) in enumerate((("measured", "#4c72b0"), ("predicted", "#dd8452"))):
        values = [rows[p]["trained tok/s"][side] for p in policies]
        cells = [rows[p]["trained tok/s"] for p in policies]
        span, name = None, "simulator (predicted)"
        if side == "measured" and all("low" in c for c in cells):  # the runtime's repeats: their range
            span = [[c["measured"] - c["low"] for c in cells], [c["high"] - c["measured"] for c in cells]]
        if side == "predicted" and all("round_predicted" in c for c in cells):  # a prediction a round: their range
            span = [
                [c["predicted"] - min(c["round_predicted"]) for c in cells],
                [max(c["round_predicted"]) - c["predicted"] for c in cells],
            ]
            name = "simulator (range: each round's own parts)"
        if side == "measured":
            name = "runtime (measured, range of runs)"
        bars = ax1.bar(x + (k - 0.5) * 0.38, values, 0.38, color=colour, yerr=span, capsize=3, label=name)
        ax1.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=7, padding=2)
    top = max(
        max(c.get("high", 0), c["measured"], c["predicted"], *c.get("round_predicted", ()))
        for c in (rows[p]["trained tok/s"] for p in policies)
    )
    ax1.set_ylim(0, 1.4 * top)  # room for the legend above the bars
    ax1.set_xticks(x, policies)
    ax1.set_ylabel("trained tokens / s")
    ax1.set_title("Throughput")
    ax1.legend(loc="upper left", fontsize=8)
    colours = {"rollout": "#55a868", "train": "#4c72b0", "sync": "#c44e52", "idle": "#cccccc"}
    for k, side in enumerate(("measured", "predicted")):
        bottom = np.zeros(len(policies))
        for phase, colour in colours.items():
            values = np.array([rows[p][f"{phase} dev-s/step"][side] for p in policies])
            ax2.bar(
                x + (k - 0.5) * 0.38,
                values,
                0.36,
                bottom=bottom,
                color=colour,
                hatch="" if k == 0 else "//",
                edgecolor="white",
                label=phase if k == 0 else None,
            )
            bottom += values
    ax2.set_ylim(0, 1.2 * ax2.get_ylim()[1])
    ax2.set_xticks(x, policies)
    ax2.set_ylabel("device-seconds per step (all resources)")
    ax2.set_title("Where a step's device time goes: runtime left, simulator right (hatched)", fontsize=10)
    ax2.legend(loc="upper right", fontsize=7, ncols=4)
    fig.suptitle(f"Simulator against runtime, costs measured part by part ({note})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130, metadata=NO_STAMP)
    plt.close(fig)


# ---- main ----


def measure_parts(model_config, task, out: Path, grid: Grid, rt_cfg, weights: str | None = None) -> dict:
    """Stage 1: writes cpu-core.yaml, model/config.json and profile.yaml; returns the measured parts. `weights`:
    the checkpoint the host's parts serve (the SWE runs' warm start: an agent's episodes need weights that act
    as the runs' do); None: fresh weights."""
    import platform

    import torch
    import yaml

    from sim.profile import DeviceInfo, ModelProfile, Profile, write_profile

    (out / "model").mkdir(parents=True, exist_ok=True)
    model_config.to_json_file(str(out / "model" / "config.json"))
    cores = os.sched_getaffinity(0)
    print("measuring: the built-in engine (decode, prefill; its own process, over HTTP) ...", flush=True)
    decode, prefill = measure_engine(model_config, task.tokenizer, grid, {min(cores)}, (cores - {min(cores)}) or cores)
    with one_core():
        print("measuring: the device (matmul, memory copy) ...", flush=True)
        device = measure_device()
        (out / "cpu-core.yaml").write_text(yaml.safe_dump(device, sort_keys=False))
        lengths = mean_lengths(task)
        print("measuring: the trainer (batches drawn from the workload, and of one length each) ...", flush=True)
        trainer = measure_trainer(
            model_config, task, task.tokenizer.pad_token_id, rt_cfg.rollout.group_size, grid, dict(rt_cfg.trainer)
        )
        print("measuring: a weight sync and a role switch ...", flush=True)
        sync = measure_sync_and_switch(model_config, max(3, grid.repeats))
        sync["batch_read_s"] = measure_batch_read(
            lengths, rt_cfg.rollout.prompts_per_step, rt_cfg.rollout.group_size, max(3, grid.repeats)
        )
    print("measuring: the trainer on its data-parallel layout (a gloo rank a core) ...", flush=True)
    trainer_cores = sorted(cores)[: rt_cfg.resources.count]
    data_parallel = measure_data_parallel(
        model_config,
        task,
        task.tokenizer.pad_token_id,
        rt_cfg.rollout.group_size,
        grid,
        dict(rt_cfg.trainer),
        trainer_cores,
    )
    print("measuring: the host's work a token (trajectory and rollout managers feeding an engine) ...", flush=True)
    host = measure_host(
        model_config,
        task,
        rt_cfg,
        {min(cores)},
        (cores - {min(cores)}) or cores,
        grid.host_groups,
        grid.repeats,
        weights,
    )
    print("measuring: a weight sync as a run meets it (through the trajectory manager) ...", flush=True)
    sync["sync_in_place"] = measure_sync_in_place(
        model_config,
        task,
        rt_cfg,
        {min(cores)},
        (cores - {min(cores)}) or cores,
        2 * grid.host_groups,
        grid.sync_every_s,
        weights,
    )
    if len(cores) >= 2:
        print("measuring: where the host's work runs beside a busy engine and a busy trainer ...", flush=True)
        host["placement"] = measure_host_placement(
            model_config,
            task,
            rt_cfg,
            min(cores),
            max(cores),
            2 * grid.host_groups,
            grid.placement_rounds,
            dict(rt_cfg.trainer),
            weights,
        )
    model_name = config_path(out / "model" / "config.json")  # the profile's entry: named as the config names it
    info = DeviceInfo(
        name=platform.processor() or platform.machine(),
        dtype="float32",
        spec=DEVICE_NAME,
        torch_device="cpu",
        torch=torch.__version__,
    )
    profile = Profile(version=1, device=info, models=(ModelProfile(model_name, tuple(decode), tuple(prefill)),))
    write_profile(profile, out / "profile.yaml")
    return {
        "device": device,
        "decode": [asdict(p) for p in decode],
        "prefill": [asdict(p) for p in prefill],
        "trainer": {"points": trainer, "data_parallel": data_parallel},
        **sync,
        "host": host,
        "model": model_name,
    }


def costs_from_parts(parts: dict, rt, task, steps: int, out: Path) -> dict:
    """The costs.* values the measured trainer, sync and switch give (the profile gives the engine's)."""
    from core import config as cfgio
    from core import specs
    from sim.config import DEFAULT_CONFIG, SimConfig

    mirror = cfgio.merge(
        cfgio.load_yaml(DEFAULT_CONFIG), sim_config_dict(rt, task, steps, out, {}, parts.get("workload"))
    )
    cfg = cfgio.from_dict(SimConfig, mirror)  # as load_config reads the file the mirror is written to
    model, device = specs.model(cfg.model), specs.device(cfg.cluster.device)
    fitted = fit_trainer(cfg, model, device, parts["trainer"]["points"])
    data_parallel = fit_data_parallel(cfg, model, device, parts["trainer"].get("data_parallel") or [], fitted)
    # The runtime reads its batch from the store and publishes the new weights inside its training step;
    # the engines load them in the sync.
    return {
        "train_mfu": fitted["train_mfu"],
        "train_attention_mfu": fitted["train_attention_mfu"],
        "train_step_overhead_s": fitted["train_step_overhead_s"] + parts["publish_s"] + parts["batch_read_s"],
        # A sync through the manager as the executor does it (parts measured before it: the engine's load alone).
        "sync_fixed_s": parts.get("sync_in_place", {}).get("sync_s", parts["load_s"]),
        "sync_busy_s": parts.get("sync_in_place", {}).get("sync_busy_s", 0.0),
        "switch_fixed_s": parts["switch_s"],
        # colocated's data-parallel step (parts measured before it have none)
        "train_dp_overhead_s": data_parallel or 0.0,
        # The host's work on the resources' cores (cluster.host_cores): parts measured before it have none.
        "host_token_s": parts.get("host", {}).get("host_token_s", 0.0),
        # ... and where it lands when both a rollout and a training core are busy (0.5: even; one core: nothing)
        "host_train_placement": parts.get("host", {}).get("placement", {}).get("host_train_placement", 0.5),
    }


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--workload",
        default="math",
        choices=WORKLOADS,
        help="math: the throughput task (default); swe: make train-swe's recipe, in Docker sandboxes, "
        "from one warm start",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="training steps of each run, runtime and simulator (10; swe: 3)"
    )
    ap.add_argument("--policies", default="all", help=f"comma-separated, or all ({', '.join(POLICIES)})")
    ap.add_argument("--out", type=Path, default=None, help=f"output folder ({DEFAULT_OUT}; swe: {DEFAULT_OUTS['swe']})")
    ap.add_argument(
        "--warm",
        type=Path,
        default=None,
        help="swe: start every run from this checkpoint (a run's weights/v00000000) instead of warm "
        "starting once first",
    )
    ap.add_argument("--overwrite", action="store_true", help="clear a non-empty --out first")
    ap.add_argument("--quick", action="store_true", help="fewer points measured (a smoke test, not a result)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="runtime runs of each policy, interleaved round by round (3)"
    )
    ap.add_argument(
        "--resimulate",
        action="store_true",
        help="measure nothing: the simulator side again, from the parts and runtime summaries already "
        "in --out (after a change to the cost model)",
    )
    ap.add_argument(
        "--measure-busy-sandboxes",
        action="store_true",
        help="swe, with --resimulate: first measure the sandboxes' work with every core busy (a part "
        "runs made before it lack; Docker, about 5 minutes)",
    )
    args = ap.parse_args(argv)
    args.steps = DEFAULT_STEPS[args.workload] if args.steps is None else args.steps
    args.out = DEFAULT_OUTS[args.workload] if args.out is None else args.out
    return args


def predict(where: Path, rt, task, steps: int, parts: dict, policies: tuple[str, ...]) -> dict:
    """Stage 3 for one round: the costs its parts give, the simulator's config (written as
    `where`/sim_config.yaml) and each policy's simulated summary, with the profile's calibration."""
    costs = costs_from_parts(parts, rt, task, steps, where)
    (where / "sim_config.yaml").write_text(_yaml(sim_config_dict(rt, task, steps, where, costs, parts.get("workload"))))
    predicted, calibration = run_sim(where / "sim_config.yaml", policies)
    return {"costs": costs, "calibration": calibration, "predicted": predicted}


def predict_rounds(out: Path, rt, task, steps: int, parts: list[dict], policies: tuple[str, ...]) -> dict:
    """Every round predicted from its own parts (`predict`): the costs and calibrations by round, each policy's
    summaries by round, and the trainer inside the runs against its round's part (`trainer_in_run`)."""
    rounds = [predict(round_dir(out, r, len(parts)), rt, task, steps, p, policies) for r, p in enumerate(parts)]
    return {
        "costs": [r["costs"] for r in rounds],
        "calibration": [r["calibration"] for r in rounds],
        "predicted": {p: [r["predicted"][p] for r in rounds] for p in policies},
        "trainer_in_run": trainer_in_run(out, parts, policies),
    }


def trainer_in_run(out: Path, parts: list[dict], policies: tuple[str, ...]) -> dict[str, dict]:
    """Each runtime step's trainer seconds (`train_s` in its metrics.jsonl: the trainers' own time in
    `train_step`) over what the simulator's trainer, with the costs its round's parts give, takes on that step's
    own sequences (read from the run's store: the groups each step consumed), without the host's share and
    without the batch read and the publishing that `train_s` leaves out. Per policy: the median and range of
    the ratios over every step of every run, and how many steps. 1 means the part measured alone predicts the
    trainer inside a run; a policy without runs under `out/runtime` is left out."""
    import json
    import sqlite3
    from collections import defaultdict

    from core import specs
    from sim import train_layout
    from sim.calibration import measured_setup
    from sim.config import load_config

    ratios: dict[str, list[float]] = {p: [] for p in policies}
    for round_, part in enumerate(parts):
        cfg = load_config(round_dir(out, round_, len(parts)) / "sim_config.yaml")
        model, device = specs.model(cfg.model), specs.device(cfg.cluster.device)
        setup = measured_setup(cfg)
        outside = part.get("publish_s", 0.0) + part.get("batch_read_s", 0.0)  # in the overhead, not in train_s
        pool = max(1, round(cfg.cluster.num_gpus * cfg.pools.train_fraction))  # the split policies' trainers
        for policy in policies:
            replicas = cfg.cluster.num_gpus if policy == "colocated" else pool
            run = run_dir(out / "runtime", policy, round_, len(parts))
            if not (run / "metrics.jsonl").is_file():
                continue
            store = sqlite3.connect(f"file:{run / 'trajectories.sqlite'}?mode=ro", uri=True)
            try:
                lengths = defaultdict(list)
                for step, tokens in store.execute(
                    "SELECT c.step, t.num_tokens FROM consumed c JOIN turns t ON t.session_id = c.item"
                ):
                    lengths[step].append(tokens)
            finally:
                store.close()
            for line in (run / "metrics.jsonl").read_text().splitlines():
                record = json.loads(line)
                if record.get("kind") != "step" or not lengths.get(record["step"]):
                    continue
                alone = train_layout.step(setup, model, device, lengths[record["step"]], replicas).total_s - outside
                ratios[policy].append(record["train_s"] / alone)
    return {
        p: {"median": statistics.median(r), "low": min(r), "high": max(r), "steps": len(r)}
        for p, r in ratios.items()
        if r
    }


def trainer_in_run_text(in_run: dict[str, dict]) -> str:
    cells = [f"{p} {r['median']:.2f} ({r['low']:.2f}-{r['high']:.2f})" for p, r in in_run.items()]
    return (
        "the trainer inside the runs against the part alone, on each step's own sequences (train_s over its "
        "prediction, median and range): " + ", ".join(cells)
    )


def _dist_mean(d: dict) -> float:
    """The mean of a `sim.config.Dist` mapping (a log-normal's, its clipping left out)."""
    return d["median"] * math.exp(d["sigma"] ** 2 / 2)


def sandboxes_in_run(out: Path, data: dict) -> dict[str, dict]:
    """The SWE runs' sandbox time an episode against the parts measured alone: each policy's mean over its runs'
    episodes (their metrics.jsonl's sums) of the seconds in tool calls, in the grader's test run and waiting
    for a workspace to start; beside them, what the sandbox part measured alone (a command's mean times the
    round's mean turns less the final submit, a test run's mean, a start's median)."""
    import json

    sandboxes, parts = data.get("sandboxes"), runs_of(data["parts"])
    if not sandboxes:
        return {}
    turns = statistics.fmean(_dist_mean(p["workload"]["turns"]) for p in parts if "workload" in p)
    alone = {
        "tool_s": _dist_mean(sandboxes["tool_latency_s"]) * max(0.0, turns - 1),
        "test_s": _dist_mean(sandboxes["test_run_s"]),
        "wait_s": sandboxes.get("start_s", {}).get("median", 0.0),
    }
    keys = {"tool_s": "tool_latency_s_sum", "test_s": "test_run_s_sum", "wait_s": "sandbox_wait_s_sum"}
    out_rows: dict[str, dict] = {}
    for policy in data["measured"]:
        sums, episodes = dict.fromkeys(keys, 0.0), 0
        for round_ in range(len(parts)):
            metrics = run_dir(out / "runtime", policy, round_, len(parts)) / "metrics.jsonl"
            if not metrics.is_file():
                continue
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                if record.get("kind") == "step":
                    e = record["episodes"]
                    episodes += sum(e["exit_reasons"].values())
                    for k, name in keys.items():
                        sums[k] += e.get(name, 0.0)
        if episodes:
            out_rows[policy] = {"episodes": episodes, **{k: v / episodes for k, v in sums.items()}, "alone": alone}
    return out_rows


def sandboxes_in_run_text(rows: dict[str, dict]) -> str:
    alone = next(iter(rows.values()))["alone"]
    cells = [f"{p} {r['tool_s']:.1f} / {r['test_s']:.1f} / {r['wait_s']:.1f}" for p, r in rows.items()]
    return (
        "an episode's seconds in tool calls / the test run / waiting for its workspace, in the runs: "
        + ", ".join(cells)
        + f"; the parts alone: {alone['tool_s']:.2f} / {alone['test_s']:.2f} / "
        f"{alone['wait_s']:.2f} (a start)"
    )


def report(out: Path, data: dict, resources: int) -> None:
    """The comparison of `data` (measured against predicted): printed, drawn, and saved with `data`."""
    rows = compare(data["measured"], data["predicted"])
    agree = agreement(rows)
    print(table(rows))
    print(agreement_text(agree))
    if data.get("trainer_in_run"):
        print(trainer_in_run_text(data["trainer_in_run"]))
    if data.get("workload") == "swe" and (in_run := sandboxes_in_run(out, data)):
        data["sandboxes_in_run"] = in_run
        print(sandboxes_in_run_text(in_run))
    if data.get("runtime_cpu"):
        first = {p: runs_of(r)[0] for p, r in data["runtime_cpu"].items()}  # the first round's
        print(cpu_table(first, os.cpu_count() or 1))
    repeats = max(len(runs_of(r)) for r in data["measured"].values())
    kind = "SWE workload in Docker sandboxes" if data.get("workload") == "swe" else "throughput workload"
    note = f"{data['steps']} steps, {repeats} runs a policy, {resources} one-core resources, {kind}"
    draw(rows, out / "validate.png", note)
    save_json(
        {**data, "comparison": rows, "agreement": agree, "sim_sources": source_fingerprint()}, out / "validate.json"
    )
    print(f"outputs: {out}/")


def resimulate(out: Path, busy: bool = False) -> int:
    """The simulator side of an earlier run again (same parts, same runtime summaries), rewritten in place.
    `busy` (SWE): the sandboxes' work with every core busy measured now first (`busy_stretch`), for a run made
    before that part existed."""
    import json

    data = json.loads((out / "validate.json").read_text())
    rt, task, _ = runtime_setup(data["steps"], data.get("workload", "math"))
    try:
        if busy:
            data["sandboxes"].update(busy_stretch(task), busy_measured_later=True)
        policies = tuple(p for p in POLICIES if p in data["measured"])
        parts = runs_of(data["parts"])
        if data.get("workload") == "swe":  # the rounds' workloads again, from their runs' stores
            for round_, part in enumerate(parts):
                part["workload"] = round_workload(
                    out / "runtime", policies, round_, len(parts), data["sandboxes"], dict(rt.trainer)
                )
        data.update(predict_rounds(out, rt, task, data["steps"], parts, policies))
        report(out, data, rt.resources.count)
    finally:
        _close(task)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _close(task) -> None:
    if (close := getattr(task, "close", None)) is not None:  # the SWE task holds threads and sandboxes
        close()


# ---- the SWE workload: one warm start, the sandboxes' times, each round's episodes ----


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    swe = args.workload == "swe"
    try:
        policies = POLICIES if args.policies == "all" else tuple(args.policies.split(","))
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:
            raise UserError(f"--policies: unknown policy {unknown[0]!r}; valid choices: {', '.join(POLICIES)}, all")
        if args.steps < 2:
            raise UserError(f"--steps must be >= 2, got {args.steps}")
        if args.repeats < 1:
            raise UserError(f"--repeats must be >= 1, got {args.repeats}")
        if args.resimulate:
            if not (args.out / "validate.json").is_file():
                raise UserError(f"--resimulate: no validate.json in {str(args.out)!r} (run without it first)")
            if args.measure_busy_sandboxes and not swe:
                raise UserError("--measure-busy-sandboxes: only with --workload swe")
            return resimulate(args.out, args.measure_busy_sandboxes)
        if args.measure_busy_sandboxes:
            raise UserError("--measure-busy-sandboxes: only with --resimulate (a new run measures it anyway)")
        if args.warm is not None and not (swe and args.warm.is_dir()):
            raise UserError(
                f"--warm {str(args.warm)!r}: "
                + ("not a directory (a checkpoint)" if swe else "only with --workload swe")
            )
        if swe:
            from swebench_env.docker_util import docker_available

            ok, why = docker_available()
            if not ok:
                raise UserError(f"--workload swe runs its episodes in Docker sandboxes: {why}")
        out = prepare_out(args.out, args.out, args.overwrite)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rt, task, model_config = runtime_setup(args.steps, args.workload)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a kill stops it as Ctrl-C does: sandboxes removed
    try:
        data = measure_all(args, policies, out, rt, task, model_config)
    finally:
        _close(task)
        signal.signal(signal.SIGTERM, previous)
    report(out, data, rt.resources.count)
    return 0


def measure_all(args: argparse.Namespace, policies: tuple[str, ...], out: Path, rt, task, model_config) -> dict:
    """Stages 1-3, round by round (the SWE workload's warm start and sandboxes measured once first)."""
    started = time.time()
    swe = args.workload == "swe"
    grid = (SWE_QUICK if args.quick else SWE_FULL) if swe else (QUICK if args.quick else FULL)
    task_args: tuple[str, ...] = ("--task", "throughput")
    warm, sandboxes = None, None
    if swe:
        warm = str(args.warm.resolve()) if args.warm else warm_weights(rt, task, out)
        sandboxes = measure_sandboxes(task)
        task_args = (
            "--config",
            str(SWE_CONFIG),
            "--model",
            warm,
            "--set",
            "warm_start.steps=0",
            "--set",
            "run.evaluate=false",
        )
    parts: list[dict] = []
    measured: dict[str, list[dict]] = {p: [] for p in policies}
    cpu: dict[str, list[dict]] = {p: [] for p in policies}
    for round_ in range(args.repeats):  # each round's parts measured just before its runs: the machine drifts
        where = round_dir(out, round_, args.repeats)
        print(f"round {round_ + 1} of {args.repeats}: the parts, then every policy's run", flush=True)
        parts.append(measure_parts(model_config, task, where, grid, rt, warm))
        summaries, usage = run_round(args.steps, policies, out / "runtime", round_, args.repeats, task_args)
        if swe:
            parts[-1]["workload"] = round_workload(
                out / "runtime", policies, round_, args.repeats, sandboxes, dict(rt.trainer)
            )
        for policy in policies:
            measured[policy].append(summaries[policy])
            cpu[policy].append(usage[policy])
    data = {
        "workload": args.workload,
        "parts": parts,
        **predict_rounds(out, rt, task, args.steps, parts, policies),
        "measured": measured,
        "runtime_cpu": cpu,
        "quick": args.quick,
        "steps": args.steps,
        "repeats": args.repeats,
    }
    if swe:
        data.update(warm=warm, sandboxes=sandboxes)
    data["seconds"] = round(time.time() - started, 1)
    return data


if __name__ == "__main__":
    sys.exit(main())
