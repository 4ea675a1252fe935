"""`python -m reference train`: argument parsing, the one-line errors, the outputs and the end-of-run table."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import yaml

from core.cli import add_config_args, add_out_args, run_main, stop_on_sigterm
from core.config import from_dict
from core.errors import UserError
from core.metrics import idle_warnings
from core.outputs import default_out, interrupted, prepare_out, provenance, source_fingerprint
from core.policies import POLICIES
from core.run_log import GEN_RATE, SEQUENCE_RATE
from core.run_log import require as require_loggers
from reference.engine.backends import check_available, training_backends

COMPARE_ORDER = tuple(POLICIES)  # colocated first: the baseline of the ratios
COMPARE_STEPS = 10  # --compare's default steps per policy: four runs of the throughput workload take minutes
COMPARE_TASK = "throughput"  # --compare measures the runtime: forced, long-tailed response lengths, as the simulator's


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="GRPO training under a scheduling policy (default config: make train-math)")
    t.add_argument(
        "--task", default=None, help=f"task name (default from the config: math; {COMPARE_TASK} with --compare)"
    )
    t.add_argument("--policy", default=None, help=f"one of: {', '.join(POLICIES)} (default from the config: tag)")
    t.add_argument("--compare", action="store_true", help="run the five policies one after another, same config")
    add_config_args(t, default_config="reference/configs/train.yaml", example="policy.num_steps=20")
    t.add_argument("--model", default=None, help="a local Qwen3 checkpoint directory to train (default: tiny)")
    t.add_argument("--backend", default=None, help=f"engine backend: {', '.join(training_backends())}")
    t.add_argument("--steps", type=int, default=None, help="training steps (policy.num_steps)")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting a local one")
    add_out_args(t, default="results/train-<policy>-<time>-seed<seed>")
    t.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run in DIR from its last checkpoint, with its config.yaml",
    )
    t.add_argument(
        "--quiet",
        action="store_true",
        help="no progress display (a bar on a terminal; elsewhere one line a step on stderr)",
    )
    t.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also write each step's metrics as TensorBoard event files in DIR (--compare: DIR/<policy>; "
        "needs tensorboardX: pip install -e '.[tensorboard]')",
    )
    t.add_argument(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="also log each step's metrics to the Weights & Biases project PROJECT (needs wandb installed)",
    )
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (resources, engines, GPU memory, whether it fits); start nothing",
    )


def _overrides(args) -> list[str]:
    task = COMPARE_TASK if args.compare and not _task_chosen(args) else args.task
    steps = args.steps
    if args.compare and steps is None and not _set(args, "policy.num_steps"):
        steps = COMPARE_STEPS
    pairs = {
        "task.name": task,
        "policy.name": args.policy,
        "model.dir": args.model,
        "engine.backend": args.backend,
        "policy.num_steps": steps,
        "run.seed": args.seed,
        "run.ray_address": args.ray_address,
    }
    if args.compare and not _set(args, "run.eval_every_steps"):
        pairs["run.eval_every_steps"] = 0  # a throughput comparison measures the pipeline, not learning
    return [*args.overrides, *(f"{k}={v}" for k, v in pairs.items() if v is not None)]


def _set(args, key: str) -> bool:
    return any(o.split("=", 1)[0].strip() == key for o in args.overrides)


def _task_chosen(args) -> bool:
    """Whether the user named the task: --task, --set task.name=... (or task=...), or a --config file's task.name."""
    from core.config import load_yaml

    if args.task is not None or any(o.split("=", 1)[0].strip() in ("task", "task.name") for o in args.overrides):
        return True
    sections = [load_yaml(path).get("task") for path in args.config or ()]
    return any(isinstance(section, dict) and "name" in section for section in sections)


@dataclasses.dataclass
class _Where:
    """A run's output folder and the folder of the policy running now (compare: a subfolder), once known: what
    the line after Ctrl-C or SIGTERM names."""

    out: Path | None = None
    run_dir: Path | None = None


def train_main(args) -> int:
    """Train (or resume, or print the plan); a user's mistake is one `error:` line and exit code 2, Ctrl-C one
    line and 130, SIGTERM the same clean stop and 143 (the task's sandboxes removed on the way out)."""
    where = _Where()
    with stop_on_sigterm():
        return run_main(lambda: _train_main(args, where), on_interrupt=lambda how: _interrupted(where, how))


def _train_main(args, where: _Where) -> int:
    from reference.control.config import config_files, load_train_config

    require_loggers(args.tensorboard, args.wandb)  # a missing package: one line before anything starts
    if args.resume is not None:
        where.out = where.run_dir = Path(args.resume)
        return _resume(where.out, args)
    cfg = load_train_config(args.config, _overrides(args))
    names = COMPARE_ORDER if args.compare else (cfg.policy.name,)
    if args.dry_run:  # before `validate`, which builds the task (a SWE task checks for Docker)
        return _dry_run(cfg, names)
    for name in names:
        validate(_with_policy(cfg, name))
    label = "compare" if args.compare else cfg.policy.name
    out = where.out = prepare_out(args.out, default_out("train", label, cfg.run.seed), args.overwrite)
    print(config_note(config_files(args.config, _overrides(args))), file=sys.stderr)  # an error stays one line
    source = source_fingerprint()  # the code as the run starts
    summaries = []
    for name in names:
        where.run_dir = out / name if args.compare else out
        summaries.append(_one(cfg, name, where.run_dir, args, source))
    print(table(summaries))
    print_warnings(summaries)
    print(f"outputs: {out}/")
    return 0


def _dry_run(cfg, names) -> int:
    from reference.control.plan import plan

    print("\n\n".join(plan(_with_policy(cfg, name)) for name in names))
    return 0


def validate(cfg) -> None:
    """Everything that can be checked before a process starts, one clear line each (UserError)."""
    from core.policies import make_policy
    from reference.control.config import check_feasible, policy_config
    from reference.tasks import make_task

    try:
        task = make_task(cfg.task.name, **cfg.task.options)
    except (ValueError, TypeError) as e:
        raise UserError(f"task: {e}") from None
    if cfg.warm_start.get("steps", 0) and not hasattr(task, "demonstrations"):
        raise UserError(f"task {cfg.task.name!r} has no demonstrations for a warm start; set warm_start.steps=0")
    check_available(cfg.engine.backend)
    check_feasible(cfg)
    from reference.ray.address import check_no_running_cluster, check_ray_address

    if cfg.run.ray_address is not None:
        check_ray_address(cfg.run.ray_address)
    else:  # a local run starts its own Ray: one already running here would be joined instead
        check_no_running_cluster()
    pcfg = policy_config(cfg)
    policy = make_policy(cfg.policy.name, pcfg, cfg.resources.count, cfg.resources.train_fraction, 1)
    if cfg.rollout.prompts_per_step < len(policy.trainers):
        raise UserError(
            f"rollout.prompts_per_step {cfg.rollout.prompts_per_step} cannot feed {len(policy.trainers)} "
            f"data-parallel train resources (each needs whole prompt groups)"
        )


def _interrupted(where: _Where, how: str) -> str:
    """The line after Ctrl-C or SIGTERM: where the outputs are, and how to go on from a checkpoint if there is
    one."""
    line = interrupted(where.out, how)
    if where.run_dir is not None and any((where.run_dir / "checkpoints").glob("step-*")):
        line += f"; `python -m reference train --resume {where.run_dir}` continues from its last checkpoint"
    return line


def config_note(files) -> str:
    """The line naming the config files merged, in order: `config: reference/configs/train.yaml + my.yaml`."""
    from reference.control.config import DEFAULT_CONFIG

    shipped = DEFAULT_CONFIG.resolve()
    try:
        shown = str(shipped.relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(shipped)
    return "config: " + " + ".join([shown, *(str(f) for f in files or ())])


def _scalar_log(args, policy: str, out: Path, resolved: dict):
    """The run's TensorBoard/W&B log (core/run_log.py), or None when neither was asked for."""
    from core.run_log import ScalarLog

    if args.tensorboard is None and args.wandb is None:
        return None
    board = None
    if args.tensorboard is not None:
        board = Path(args.tensorboard) / policy if getattr(args, "compare", False) else Path(args.tensorboard)
    return ScalarLog(
        board, args.wandb, run_name=f"{out.name}-{policy}" if args.wandb else None, config=resolved, wandb_dir=out
    )


def _one(cfg, policy: str, out: Path, args, source: dict) -> dict:
    from reference.control.report import logging_to, write_outputs
    from reference.train import train

    cfg = _with_policy(cfg, policy)
    print(
        f"training {cfg.task.name} under {policy}: {cfg.policy.num_steps} steps of {cfg.rollout.prompts_per_step} "
        f"x {cfg.rollout.group_size} samples on {cfg.resources.count} resources ...",
        file=sys.stderr,
    )
    resolved = {**dataclasses.asdict(cfg), "provenance": provenance(policy, source)}  # not config: --resume skips it
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))  # --resume reads it
    with logging_to(_scalar_log(args, policy, out, resolved)):
        timeline, metrics = train(cfg, out, progress=not args.quiet)
    summary = write_outputs(timeline, metrics, resolved, out)
    _print_instances(metrics, out)
    return summary


def _print_instances(metrics, out: Path) -> None:
    """Each problem's pass@1 at the start and the end of RL, for a task evaluated on its training problems too."""
    from reference.control.report import instance_table

    text = instance_table(metrics)
    if text and any("train_instances" in e for e in metrics.evaluations):
        print(f"{text}\n(every evaluation's figures: {out}/instances.csv)")


def _with_new_keys(resolved: dict) -> dict:
    """A saved run's resolved config with what was added since it was written at its defaults: a section key
    with a default value (`policy.drain`, `run.held_out_samples`, ...), the `warm_start` section (steps 0) and
    the `trainer_parallel` section (its defaults: plain data parallel in fp32)."""
    import typing

    from reference.control.config import TrainConfig

    resolved.setdefault("warm_start", {"steps": 0})
    resolved.setdefault("trainer_parallel", {})
    for name, section in typing.get_type_hints(TrainConfig).items():
        if dataclasses.is_dataclass(section) and isinstance(resolved.get(name), dict):
            for f in dataclasses.fields(section):
                if f.default is not dataclasses.MISSING:
                    resolved[name].setdefault(f.name, f.default)
    return resolved


def _resume(out: Path, args) -> int:
    from reference.control.config import TrainConfig
    from reference.control.report import logging_to, write_outputs
    from reference.train import train

    saved = out / "config.yaml"
    if not saved.is_file():
        raise UserError(f"--resume {str(out)!r}: no config.yaml there (not a training run's folder)")
    resolved = _with_new_keys(yaml.safe_load(saved.read_text()))
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = from_dict(TrainConfig, {k: v for k, v in resolved.items() if k in fields})
    print(f"resuming {out} ...", file=sys.stderr)
    with logging_to(_scalar_log(args, cfg.policy.name, out, resolved)):
        timeline, metrics = train(cfg, out, progress=not args.quiet, resume=True)
    summary = write_outputs(timeline, metrics, {**resolved, "resumed": provenance(cfg.policy.name)}, out)
    _print_instances(metrics, out)
    print(table([summary]))
    print_warnings([summary])
    print(f"outputs: {out}/")
    return 0


def _with_policy(cfg, name: str):
    return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, name=name))


def table(summaries: list[dict]) -> str:
    rows = [
        ("policy", lambda s: s["policy"]),
        (SEQUENCE_RATE, lambda s: f"{s['token_throughput']:,.0f}"),
        (GEN_RATE, lambda s: f"{s['generated_token_throughput']:,.0f}"),
        ("step time mean (s)", lambda s: f"{s['step_time_s']['mean']:.2f}"),
        ("bubble fraction", lambda s: f"{s['bubble_fraction']:.1%}"),
        (
            "reward first -> last step",
            lambda s: _pair(s["training"]["reward_first_step"], s["training"]["reward_last_step"]),
        ),
        (
            "held-out reward start -> end",
            lambda s: _pair(s["training"]["held_out_first"], s["training"]["held_out_last"]),
        ),
        ("staleness (lag: share)", lambda s: _staleness(s)),
    ]
    base = next((s for s in summaries if s["policy"] == "colocated"), None)
    if base is not None and len(summaries) > 1:
        rows.insert(2, ("ratio to colocated", lambda s: f"{s['token_throughput'] / base['token_throughput']:.2f}x"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  " + "  ".join(f"{fn(s):>16}" for s in summaries) for name, fn in rows)


def print_warnings(summaries: list[dict]) -> None:
    """A line for each pool that idled most of its run (`core.metrics.idle_warnings`)."""
    for summary in summaries:
        for line in idle_warnings(summary, unit="resources"):
            print(line)


def _pair(a, b) -> str:
    return "-" if a is None or b is None else f"{a:.3f} -> {b:.3f}"


def _staleness(s: dict) -> str:
    hist = s["staleness"]["histogram"]
    total = sum(hist.values()) or 1
    return " ".join(f"{lag}:{n / total:.0%}" for lag, n in hist.items())
