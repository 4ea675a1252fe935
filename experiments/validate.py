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

The parts are measured by `runtime_parts.py` and `trainer_parts.py`; the runtime's setup and the simulator's
mirror of it are `validate_setup.py`'s, the runs' CPU `cpu_sampler.py`'s, the comparison `comparison.py`'s
(with the parts inside the runs against the parts alone in `in_run.py`), the SWE workload `validate_swe.py`'s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from core.cli import add_out_args, run_main, stop_on_sigterm
from core.errors import UserError
from core.outputs import interrupted, prepare_out
from experiments._common import save_json, source_fingerprint
from experiments.comparison import POLICIES, agreement, agreement_text, compare, draw, runs_of, table
from experiments.cpu_sampler import CpuSampler, cpu_table
from experiments.in_run import sandboxes_in_run, sandboxes_in_run_text, trainer_in_run, trainer_in_run_text
from experiments.runtime_parts import (
    DEVICE_NAME,
    FULL,
    QUICK,
    Grid,
    measure_batch_read,
    measure_device,
    measure_engine,
    measure_host,
    measure_host_placement,
    measure_sync_and_switch,
    measure_sync_in_place,
    one_core,
)
from experiments.trainer_parts import fit_data_parallel, fit_trainer, measure_data_parallel, measure_trainer
from experiments.validate_setup import (
    SWE_CONFIG,
    config_path,
    mean_lengths,
    round_dir,
    run_dir,
    runtime_setup,
    sim_config_dict,
)
from experiments.validate_swe import busy_stretch, measure_sandboxes, round_workload, warm_weights

WORKLOADS = ("math", "swe")
DEFAULT_OUT = Path("experiments/out/validate")
DEFAULT_OUTS = {"math": DEFAULT_OUT, "swe": Path("experiments/out/validate-swe")}
DEFAULT_STEPS = {"math": 10, "swe": 3}
# The SWE workload's parts: decode at its episodes' contexts (a prompt of about 770 tokens, episodes of 1,700-
# 2,300), its turns' prefills, the trainer on a step's 32 episodes (and halves), a step's 8 groups (and halves)
# feeding the host's parts.
# A sync while generating every 5 s: an engine re-prefills its requests' contexts after each (a few seconds at 16
# episodes of 2,000 tokens on one core), so syncs every 0.25 s, as for math, would leave it nothing but prefills.
SWE_FULL = Grid((1, 8, 32), (256, 1024, 2048), 16, (64, 256, 1024, 2048), (16, 32), 2, 4, 16384, 1, 5.0)
SWE_QUICK = Grid((1, 8), (256, 1024), 8, (64, 512), (4, 8), 1, 2, 4096, 1, 5.0)
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
    add_out_args(ap, default=f"{DEFAULT_OUT}; swe: {DEFAULT_OUTS['swe']}")
    ap.add_argument(
        "--warm",
        type=Path,
        default=None,
        help="swe: start every run from this checkpoint (a run's weights/v00000000) instead of warm "
        "starting once first",
    )
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


def _close(task) -> None:
    if (close := getattr(task, "close", None)) is not None:  # the SWE task holds threads and sandboxes
        close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with stop_on_sigterm():  # a kill stops it as Ctrl-C does: sandboxes removed
        return run_main(lambda: _validate(args), on_interrupt=lambda how: interrupted(args.out, how))


def _validate(args: argparse.Namespace) -> int:
    policies = check_args(args)
    if args.resimulate:
        return resimulate(args.out, args.measure_busy_sandboxes)
    out = prepare_out(args.out, args.out, args.overwrite)
    rt, task, model_config = runtime_setup(args.steps, args.workload)
    try:
        data = measure_all(args, policies, out, rt, task, model_config)
    finally:
        _close(task)
    report(out, data, rt.resources.count)
    return 0


def check_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The policies to run, once every flag is checked: a bad value or combination is a UserError."""
    swe = args.workload == "swe"
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
        return policies
    if args.measure_busy_sandboxes:
        raise UserError("--measure-busy-sandboxes: only with --resimulate (a new run measures it anyway)")
    if args.warm is not None and not (swe and args.warm.is_dir()):
        raise UserError(
            f"--warm {str(args.warm)!r}: " + ("not a directory (a checkpoint)" if swe else "only with --workload swe")
        )
    if swe:
        from swebench_env.docker_util import docker_available

        ok, why = docker_available()
        if not ok:
            raise UserError(f"--workload swe runs its episodes in Docker sandboxes: {why}")
    return policies


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
