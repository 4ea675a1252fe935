"""`python -m sim`: run one policy, or `--compare` all four, and write the outputs.

python -m sim --policy tag
python -m sim --compare --set workload.kind=swe --set cluster.num_gpus=128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from core.errors import UserError
from core.policies import POLICIES, policy_class
from sim.config import DEFAULT_CONFIG, load_config
from sim.report import ratio_table, ratios, table, write_run
from sim.runner import simulate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sim", description="Simulate GRPO post-training under a policy.")
    p.add_argument("--policy", default="tag", help=f"one of: {', '.join(POLICIES)} (default: tag)")
    p.add_argument("--compare", action="store_true", help="run all four policies on the same config and seed")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML merged over the default config")
    p.add_argument("--out", default=None, help="output folder (default: results/sim-<policy>-<time>)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set cluster.num_gpus=128 (repeatable)",
    )
    p.add_argument("--no-picture", action="store_true", help="skip timeline.png (faster for big clusters)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    names = list(POLICIES) if args.compare else [args.policy]
    for name in names:
        policy_class(name)
    label = "compare" if args.compare else args.policy
    out = Path(args.out) if args.out else Path("results") / f"sim-{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    summaries = []
    for name in names:
        timeline = simulate(cfg, name, progress=not args.quiet)
        run_dir = out / name if args.compare else out
        summaries.append(write_run(timeline, cfg, run_dir, picture=not args.no_picture))
    print(
        f"{cfg.model} | {cfg.workload.kind} | {cfg.cluster.num_gpus} x {cfg.cluster.device} | "
        f"{cfg.num_steps} steps | seed {cfg.seed}"
    )
    print(table(summaries))
    if args.compare:
        r = ratios(summaries)
        (out / "compare.json").write_text(json.dumps(r, indent=2, sort_keys=True) + "\n")
        print(ratio_table(r))
    print(f"outputs: {out}/")
    return 0
