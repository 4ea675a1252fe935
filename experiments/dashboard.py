"""What `--tensorboard DIR` shows: a short math training run as TensorBoard's scalar dashboard draws it.

Question: a newcomer about to run `python -m reference train --tensorboard DIR` wants to know what the dashboard
will hold and what a run that learns looks like there: the training reward climbing, the held-out score
following it, the throughput, the staleness, the loss, the policy's entropy and the step time.

It runs, in a temporary folder, on this CPU (the learnable math task of `reference/configs/train.yaml`, two
resources of one core each, held-out evaluations every 10 steps):

    python -m reference train --task math --policy tag --seed 0 --set policy.num_steps=150 --tensorboard TB

then reads TB's event files back (`core.run_log.read_scalars`: tensorboardX's Event records, so TensorBoard
itself need not be installed) and draws nine of the scalars as a grid of small cards, one a tag, x = steps done,
as TensorBoard's scalar dashboard does: the raw values faint, and over them the same values smoothed as
TensorBoard smooths them by default (a debiased exponential moving average, weight 0.6). The held-out
evaluations (16 points) are drawn as logged: where TensorBoard would smooth them too, the line would trail the
points by several evaluations.

    python -m experiments.dashboard [--steps 150] [--seed 0] [--out DIR]
    python -m experiments.dashboard --replot     # redraw from the saved scalars.json

Writes, in `--out` (default experiments/out/dashboard): dashboard.png; scalars.json (the command, the run's wall
time, and the drawn scalars: tag -> [[step, value], ...]) and scalars.csv (every scalar of the event files, one
row a value: tag, step, value); the run's config.yaml (resolved, with its provenance) and summary.json. Numbers
are wall-clock measurements on this machine, which is shared: a rerun's throughput and step times differ.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from core.cli import run_main
from core.plot import save_figure
from core.run_log import read_scalars

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "dashboard"
SMOOTHING = 0.6  # TensorBoard's default smoothing
FEW_POINTS = 30  # a series this short (the held-out evaluations) is drawn as it is: smoothing would lag it
CARDS = (  # (tag, what it is): the grid, row by row
    ("train/reward_mean", "training reward (mean of the step's samples)"),
    ("eval/reward_mean", "held-out reward (every 10 steps)"),
    ("eval/exact_match", "held-out exact match"),
    ("train/gen_tokens_per_s", "generated tokens trained per second, run so far"),
    ("train/staleness_mean", "mean policy-version lag of trained tokens"),
    ("train/step_s", "seconds per training step"),
    ("train/loss", "loss: policy gradient - 0.04 x entropy"),
    ("train/entropy", "policy entropy (nats per token)"),
    ("train/grad_norm", "gradient norm (before clipping)"),
)


def command(steps: int, seed: int, board: Path, run: Path) -> list[str]:
    """The training run, as the module docstring gives it."""
    task = ["--task", "math", "--policy", "tag", "--seed", str(seed), "--set", f"policy.num_steps={steps}"]
    return [sys.executable, "-m", "reference", "train", *task, "--tensorboard", str(board), "--out", str(run)]


def run(steps: int, seed: int, out: Path) -> dict:
    """Train, then keep the event files' scalars, the run's config.yaml and summary.json in `out`."""
    with tempfile.TemporaryDirectory(prefix="dashboard-") as tmp:
        board, folder = Path(tmp) / "tb", Path(tmp) / "run"
        cmd = command(steps, seed, board, folder)
        print(" ".join(["python", *cmd[1:]]), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)  # the step lines go to stderr
        if done.returncode != 0:
            raise SystemExit(f"error: the training run exited {done.returncode}")
        print(done.stdout, end="")
        for name in ("config.yaml", "summary.json"):
            shutil.copyfile(folder / name, out / name)
        scalars = read_scalars(board)
    # TensorBoard stores float32: 7 significant digits are its precision
    found = {tag: [[step, float(f"{value:.7g}")] for step, value in points] for tag, points in scalars.items()}
    shown = ["python", "-m", *cmd[2:]]
    shown[shown.index("--tensorboard") + 1], shown[shown.index("--out") + 1] = "TB", "OUT"
    summary = json.loads((out / "summary.json").read_text())
    return {"command": " ".join(shown), "steps": steps, "seed": seed, "wall_s": summary["wall_s"], "scalars": found}


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, divided by 1 - weight^n so it starts unbiased."""
    out, last = [], 0.0
    for n, value in enumerate(values, 1):
        last = last * weight + (1 - weight) * value
        out.append(last / (1 - weight**n))
    return out


def save_data(data: dict, path: Path) -> None:
    """scalars.json: the run's description, then the drawn cards' series, one line a tag (every tag: scalars.csv)."""
    head = {k: v for k, v in data.items() if k != "scalars"}
    drawn = {tag: data["scalars"][tag] for tag, _ in CARDS if tag in data["scalars"]}
    lines = ",\n".join(f"    {json.dumps(tag)}: {json.dumps(points)}" for tag, points in drawn.items())
    path.write_text(json.dumps(head, indent=2, sort_keys=True)[:-2] + f',\n  "scalars": {{\n{lines}\n  }}\n}}\n')


def write_csv(scalars: dict[str, list], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["tag", "step", "value"])
        for tag in sorted(scalars):
            w.writerows([tag, step, value] for step, value in scalars[tag])


def draw(data: dict, path: Path) -> None:
    """The cards in a 3 x 3 grid, titled like TensorBoard's (the tag), with what each is under the tag."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12.0, 9.0), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 3).ravel()
    for ax, (tag, meaning) in zip(axes, CARDS, strict=True):
        points = data["scalars"].get(tag, [])
        steps, values = [p[0] for p in points], [p[1] for p in points]
        if len(points) < FEW_POINTS:  # the evaluations: each point as it is, joined
            ax.plot(steps, values, color="#f57c00", linewidth=1.6, marker="o", markersize=3.5)
        else:
            ax.plot(steps, values, color="#f57c00", alpha=0.3, linewidth=1.0)
            ax.plot(steps, smooth(values), color="#f57c00", linewidth=1.6)
        ax.set_title(f"{tag}\n{meaning}", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if not points:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
    for ax in axes[-3:]:
        ax.set_xlabel("steps done", fontsize=8)
    fig.suptitle(
        f"TensorBoard scalars of a short run: GRPO on the math task, tag, {data['steps']} steps, seed "
        f"{data['seed']}, 2 CPU resources, {data['wall_s']:,.0f} s of RL\n(faint: the logged values; line: "
        f"TensorBoard's smoothing {SMOOTHING:g}; the held-out evaluations' points as logged)",
        fontsize=10,
    )
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="training steps (default 150: 2-4 minutes here)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--replot", action="store_true", help="redraw from OUT/scalars.json; run nothing")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    data_path = args.out / "scalars.json"
    if args.replot and not data_path.is_file():
        parser.error(f"--replot needs {data_path}; run without --replot first")
    return run_main(lambda: dashboard(args, data_path))


def dashboard(args: argparse.Namespace, data_path: Path) -> int:
    """The training run (or, with --replot, its scalars saved in `data_path`), then the picture."""
    if args.replot:
        data = json.loads(data_path.read_text())
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        data = run(args.steps, args.seed, args.out)
        write_csv(data["scalars"], args.out / "scalars.csv")
        save_data(data, data_path)
    draw(data, args.out / "dashboard.png")
    print(f"outputs: {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
