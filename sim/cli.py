"""`python -m sim`: run one policy, or `--compare` all five, and write the outputs.

python -m sim --policy tag                               (`python -m sim run ...` is the same)
python -m sim --compare --set workload.kind=swe --set cluster.num_gpus=128
python -m sim --config sim/configs/swe.yaml --config my.yaml   (later files win key by key)
python -m sim search --config sim/configs/swe.yaml      (the layout search: sim/search.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from core import config as cfgio
from core.cli import EXIT_INTERRUPTED, add_config_args, add_out_args, run_main
from core.metrics import idle_warnings
from core.outputs import default_out, interrupted, prepare_out, provenance, source_fingerprint
from core.policies import POLICIES
from core.run_log import require as require_loggers
from sim.config import SimConfig, merged_note, resolve
from sim.report import ratio_table, ratios, table, write_run
from sim.runner import Simulation


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sim",
        description="Simulate GRPO post-training under a policy.",
        epilog="subcommands: `python -m sim [run] [options]` simulates (this page); "
        "`python -m sim search --help`: the layout search (the fastest layouts of a config).",
    )
    p.add_argument("--policy", default="tag", help=f"one of: {', '.join(POLICIES)} (default: tag)")
    p.add_argument("--compare", action="store_true", help="run every policy on the same config and seed")
    add_config_args(
        p,
        default_config="sim/configs/default.yaml",
        example="cluster.num_gpus=128",
        note="; a chosen workload.kind brings its own defaults first",
    )
    add_out_args(p, default="results/sim-<policy>-<time>-seed<seed>")
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also write each simulated step's metrics as TensorBoard event files in DIR (--compare: "
        "DIR/<policy>; needs tensorboardX: pip install tensorboardX)",
    )
    p.add_argument("--no-picture", action="store_true", help="skip timeline.png (faster for big clusters)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        argv = argv[1:]
    if argv[:1] == ["search"]:
        from sim.search import main as search

        return search(argv[1:])
    args = parse_args(argv)
    # Ctrl-C before the output folder exists (during a run: see _run)
    return run_main(lambda: _run(args), on_interrupt=lambda how: interrupted(None, how))


def _run(args: argparse.Namespace) -> int:
    require_loggers(args.tensorboard)
    data, files = resolve(args.config, args.overrides)
    cfg = cfgio.from_dict(SimConfig, data)
    names = list(POLICIES) if args.compare else [args.policy]
    if args.compare and cfg.cluster.rollout_pool is not None:  # colocated cannot use rollout-only GPUs
        names.remove("colocated")
    # every check, nothing run
    sims = {name: Simulation.from_config(cfg, name, progress=not args.quiet) for name in names}
    label = "compare" if args.compare else args.policy
    made = args.out is None or not args.out.exists()  # a folder this run creates (an empty one goes at Ctrl-C)
    out = prepare_out(args.out, default_out("sim", label, cfg.seed), args.overwrite)
    try:
        print(merged_note(files), file=sys.stderr)  # every input checked: an error stays one line
        source = source_fingerprint()  # the code as the run starts
        summaries = [
            _run_one(sim, cfg, out / name if args.compare else out, args, source) for name, sim in sims.items()
        ]
    except KeyboardInterrupt:
        if made:
            remove_empty(out)
        print(interrupted(out), file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"{cfg.model} | {cfg.workload.kind} | {cfg.cluster_label} | {cfg.num_steps} steps | seed {cfg.seed}")
    print(table(summaries))
    for warning in (line for summary in summaries for line in idle_warnings(summary)):
        print(warning)
    if args.compare:
        baseline = names[0]  # colocated, or on a mixed cluster disaggregated
        r = ratios(summaries, baseline)
        (out / "compare.json").write_text(json.dumps(r, indent=2, sort_keys=True) + "\n")
        if not args.no_picture:  # every policy's timeline on one shared time axis, read back from its folder
            from core.plot_compare import draw_compare
            from core.timeline import Timeline

            draw_compare([Timeline.load(out / name / "intervals.json") for name in names], out / "compare.png")
        print(ratio_table(r, baseline))
    print(f"outputs: {out}/")
    return 0


def _run_one(sim: Simulation, cfg: SimConfig, out: Path, args: argparse.Namespace, source: dict) -> dict:
    timeline = sim.run()
    if args.tensorboard is not None:
        board = Path(args.tensorboard) / sim.policy.name if args.compare else Path(args.tensorboard)
        write_steps(timeline, board)
    record = provenance(sim.policy.name, source)
    return write_run(timeline, cfg, out, picture=not args.no_picture, provenance=record)


def write_steps(timeline, board: Path) -> None:
    """Each simulated step's figures as TensorBoard scalars (step = steps done; the simulated clock's seconds as
    `time_s`): the run's tokens per second so far, of the trained sequences (`sequence_tokens_per_s`: prompts
    and responses, the summary's token throughput) and generated only (`gen_tokens_per_s`, as the runtime logs),
    the step's mean staleness, its tokens and seconds."""
    from core.run_log import ScalarLog, mean_lag

    trained = generated = 0
    with ScalarLog(board) as log:
        for done, step in enumerate(sorted(timeline.steps, key=lambda s: s.step), 1):
            trained += step.tokens
            generated += step.generated_tokens
            log.log(
                done,
                {
                    "sequence_tokens_per_s": trained / step.end_s if step.end_s > 0 else 0.0,
                    "gen_tokens_per_s": generated / step.end_s if step.end_s > 0 else 0.0,
                    "staleness_mean": mean_lag(step.lag_tokens),
                    "trained_tokens": float(step.tokens),
                    "generated_tokens": float(step.generated_tokens),
                    "samples": float(step.samples),
                    "step_s": step.end_s - step.start_s,
                    "time_s": step.end_s,
                },
            )


def remove_empty(folder: Path) -> None:
    """Remove `folder` and the folders inside it if no file was written there (a run interrupted before its
    first output): Ctrl-C leaves no empty output folder behind."""
    try:
        if any(p.is_file() or p.is_symlink() for p in folder.rglob("*")):
            return
        for sub in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            sub.rmdir()
        folder.rmdir()
    except OSError:  # written to meanwhile, or not ours to remove: leave it
        pass
