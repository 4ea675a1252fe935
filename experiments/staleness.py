"""Staleness against convergence on the real runtime: what a policy-version lag costs in steps, and whether
the throughput it buys outruns that.

Question (the paper's open one): tag scheduling trains on tokens up to one policy version old, async and
streaming on tokens up to `max_staleness` versions old. Off-policy tokens may slow learning per step; the
overlap they allow speeds each step up. Which wins, on a task that learns?

It runs `python -m reference train` (the learnable math task, `reference/configs/train.yaml`, on this CPU)
for colocated (lag 0), tag (lag 1), and async and streaming at bounds 1, 2 and 4, on each seed, one after
another, and reads each run's metrics.jsonl: the training reward of every step (the mean reward of the
samples the step trained on) against its step and its wall time since RL began, the lag of every trained
token, and the held-out pass@1 at the end. Numbers are wall-clock measurements on this machine; a run per
(setting, seed), the comparison within one invocation.

    python -m experiments.staleness [--seeds 0,1,2] [--steps 250] [--out DIR]
    python -m experiments.staleness --replot     # redraw the picture from the saved data

Writes, in `--out` (default experiments/out/staleness): staleness.json (every run's steps and its
summary), staleness.png (reward against steps and against wall time, the mean over seeds of each
setting with its range), and prints a table: steps and seconds to reach a training reward of
`--target` (mean over seeds; a seed that never reaches it counts as not reached), mean lag, final
held-out pass@1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from core.cli import run_main
from core.outputs import interrupted
from experiments._common import NO_STAMP, save_json

SETTINGS = (  # (label, policy, max_staleness)
    ("colocated", "colocated", 1),
    ("tag", "tag", 1),
    ("async b1", "async", 1),
    ("async b2", "async", 2),
    ("async b4", "async", 4),
    ("streaming b1", "streaming", 1),
    ("streaming b2", "streaming", 2),
    ("streaming b4", "streaming", 4),
)
DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "staleness"


def run_one(policy: str, bound: int, seed: int, steps: int, out: Path) -> dict:
    """One training run; its per-step rewards, times and lags, and the final held-out evaluation."""
    cmd = [
        sys.executable,
        "-m",
        "reference",
        "train",
        "--task",
        "math",
        "--policy",
        policy,
        "--seed",
        str(seed),
        "--set",
        f"policy.num_steps={steps}",
        "--set",
        f"policy.max_staleness={bound}",
        "--set",
        "run.eval_every_steps=0",
        "--out",
        str(out),
    ]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"error: {' '.join(cmd)} exited {done.returncode}:\n{tail}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_records = [r for r in records if r.get("kind") == "step"]
    evaluations = [r for r in records if r.get("kind") == "held_out"]
    lag_tokens: dict[int, int] = {}
    for r in step_records:
        for lag, n in (r.get("staleness") or {}).items():
            lag_tokens[int(lag)] = lag_tokens.get(int(lag), 0) + n
    total = sum(lag_tokens.values()) or 1
    end = max(evaluations, key=lambda e: e["step"]) if evaluations else {}
    return {
        "steps": [{"step": r["step"], "time_s": r["time_s"], "reward": r["reward_mean"]} for r in step_records],
        "mean_lag": sum(lag * n for lag, n in lag_tokens.items()) / total,
        "held_out_end": end.get("reward_mean"),
        "wall_s": time.monotonic() - start,
    }


def reach(steps: list[dict], target: float, window: int) -> tuple[int | None, float | None]:
    """The first step (and its time) at which the mean training reward over the last `window` steps reaches
    `target`; (None, None) if it never does."""
    for i in range(window - 1, len(steps)):
        if statistics.fmean(s["reward"] for s in steps[i - window + 1 : i + 1]) >= target:
            return steps[i]["step"] + 1, steps[i]["time_s"]
    return None, None


def summarise(data: dict, target: float, window: int) -> list[dict]:
    rows = []
    for label, _, _ in SETTINGS:
        runs = data["runs"].get(label, {})
        if not runs:
            continue
        reached = [reach(r["steps"], target, window) for r in runs.values()]
        steps_to = [s for s, _ in reached if s is not None]
        secs_to = [t for _, t in reached if t is not None]
        step_s = [r["steps"][-1]["time_s"] / len(r["steps"]) for r in runs.values() if r["steps"]]
        rows.append(
            {
                "setting": label,
                "seeds": len(runs),
                "reached": len(steps_to),
                "steps_to_target": statistics.fmean(steps_to) if steps_to else None,
                "seconds_to_target": statistics.fmean(secs_to) if secs_to else None,
                "seconds_a_step": statistics.fmean(step_s) if step_s else None,
                "mean_lag": statistics.fmean(r["mean_lag"] for r in runs.values()),
                "held_out_end": statistics.fmean(ends)
                if (ends := [r["held_out_end"] for r in runs.values() if r["held_out_end"] is not None])
                else None,
            }
        )
    return rows


def print_table(rows: list[dict], target: float, window: int) -> None:
    print(f"training reward >= {target} (mean of {window} steps): steps and seconds to reach it, mean over the seeds")
    print(f"{'setting':<14}{'reached':>9}{'steps':>8}{'seconds':>9}{'s/step':>8}{'lag':>6}{'held-out':>10}")
    for r in rows:
        steps = "-" if r["steps_to_target"] is None else f"{r['steps_to_target']:.0f}"
        secs = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        held = "-" if r["held_out_end"] is None else f"{r['held_out_end']:.3f}"
        print(
            f"{r['setting']:<14}{r['reached']:>5}/{r['seeds']:<3}{steps:>8}{secs:>9}{r['seconds_a_step']:>8.3f}"
            f"{r['mean_lag']:>6.2f}{held:>10}"
        )


def plot(data: dict, path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = {"colocated": "#444444", "tag": "#d62728", "async": "#1f77b4", "streaming": "#2ca02c"}
    styles = {1: "-", 2: "--", 4: ":"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for label, policy, bound in SETTINGS:
        runs = list(data["runs"].get(label, {}).values())
        if not runs:
            continue
        n = min(len(r["steps"]) for r in runs)
        rewards = np.array([[s["reward"] for s in r["steps"][:n]] for r in runs])
        times = np.array([[s["time_s"] for s in r["steps"][:n]] for r in runs])
        kernel = np.ones(5) / 5  # a 5-step moving mean: a step's reward is one batch's
        smooth = np.array([np.convolve(row, kernel, mode="valid") for row in rewards])
        x = np.arange(1, n + 1)[4:]
        style = "-" if policy in ("colocated", "tag") else styles[bound]
        kw = {"color": colors[policy], "linestyle": style, "linewidth": 1.6}
        axes[0].plot(x, smooth.mean(0), label=label, **kw)
        axes[0].fill_between(x, smooth.min(0), smooth.max(0), color=colors[policy], alpha=0.08)
        axes[1].plot(times.mean(0)[4:], smooth.mean(0), label=label, **kw)
    for ax, xlabel in zip(axes, ("RL step", "wall time since RL began (s)"), strict=True):
        ax.axhline(target, color="#999999", linewidth=0.8, linestyle="-.")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training reward (5-step mean; band: range over seeds)")
    axes[0].set_title("reward against steps: what a lag costs")
    axes[1].set_title("reward against wall time: what the overlap buys")
    axes[1].legend(loc="lower right", fontsize=8, ncol=2)
    seeds = ", ".join(str(s) for s in data["seeds"])
    fig.suptitle(f"Staleness against convergence: math task on this CPU, seeds {seeds} (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=NO_STAMP)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--steps", type=int, default=250, help="RL steps a run (default 250)")
    parser.add_argument("--target", type=float, default=0.8, help="training reward to reach (default 0.8)")
    parser.add_argument("--window", type=int, default=5, help="steps the reward is averaged over (default 5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--replot", action="store_true", help="redraw from OUT/staleness.json; run nothing")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not seeds or args.steps < args.window or args.window < 1 or not 0 < args.target <= 1:
        parser.error("need at least one seed, --window >= 1, --steps >= --window and --target in (0, 1]")
    args.out.mkdir(parents=True, exist_ok=True)
    data_path = args.out / "staleness.json"
    if args.replot and not data_path.is_file():
        parser.error(f"--replot needs {data_path}; run without --replot first")
    return run_main(lambda: sweep(args, seeds, data_path), on_interrupt=lambda how: interrupted(args.out, how))


def sweep(args: argparse.Namespace, seeds: list[int], data_path: Path) -> int:
    """Every setting's runs (or, with --replot, those saved in `data_path`), then the table and the picture."""
    if args.replot:
        data = json.loads(data_path.read_text())
    else:
        data = {"seeds": seeds, "steps": args.steps, "runs": {}}
        total = len(SETTINGS) * len(seeds)
        with tempfile.TemporaryDirectory(prefix="staleness-") as tmp:
            for i, (label, policy, bound) in enumerate(SETTINGS):
                for j, seed in enumerate(seeds):
                    n = i * len(seeds) + j + 1
                    print(f"[{n}/{total}] {label}, seed {seed} ...", flush=True)
                    run = run_one(policy, bound, seed, args.steps, Path(tmp) / f"{policy}-{bound}-{seed}")
                    data["runs"].setdefault(label, {})[str(seed)] = run
                    save_json(data, data_path)  # as it goes: an interrupted sweep keeps what it measured
    rows = summarise(data, args.target, args.window)
    data["summary"] = rows
    save_json(data, data_path)
    print_table(rows, args.target, args.window)
    plot(data, args.out / "staleness.png", args.target)
    print(f"outputs: {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
