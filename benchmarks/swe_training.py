"""Where does the time of SWE training go? Episodes per minute, and the shares of generating, sandboxes and training.

Reads a finished `python -m reference train --task swe` run (`--run DIR`, e.g. `make train-swe`'s output), or
first makes a short one (`--steps`, a small warm start, the shipped suite, Docker sandboxes, in a temporary
folder), and prints:

- episodes per minute of the RL run (training episodes only; evaluations are counted apart);
- of the episodes' own time (summed over episodes, so concurrent episodes each count), the shares spent
  waiting for the model (`model_s`: generation, queueing and weight syncs included), running tools in the
  sandbox (`tool_latency_s`: the agent's commands and the final diff; the workspace's start and removal are
  not in any of the three) and grading (`test_run_s`: a fresh sandbox, the patch applied, the tests run),
  named as the simulator's SWE workload names them;
- of the resources' wall time (the run's timeline), the shares each spent generating (`rollout`), training
  (`train`), syncing weights, switching and idle.

    python -m benchmarks.swe_training [--run DIR] [--steps 3] [--sandbox docker|local] [--agent builtin]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from core.timeline import Timeline

SHORT_RUN = [
    "task.options.max_turns=8", "rollout.prompts_per_step=4", "rollout.group_size=2", "run.eval_every_steps=0",
    "warm_start.steps=20",
]  # fmt: skip


def make_run(out: Path, steps: int, sandbox: str, agent: str) -> None:
    """A short SWE training run in `out` (its own process, as `make train-swe` runs it)."""
    args = [sys.executable, "-m", "reference", "train", "--config", "reference/configs/swe.yaml", "--out", str(out),
            "--steps", str(steps), "--quiet", "--set", f"task.options.sandbox={sandbox}",
            "--set", f"task.options.agent={agent}"]  # fmt: skip
    for item in SHORT_RUN:
        args += ["--set", item]
    subprocess.run(args, check=True)


def episode_shares(metrics: list[dict]) -> dict:
    """Episodes, their exit reasons and the time they spent in each part, from the run's step records."""
    steps = [m for m in metrics if m.get("kind") == "step"]
    reasons: Counter = Counter()
    sums: Counter = Counter()
    for s in steps:
        episodes = s.get("episodes", {})
        reasons.update(episodes.get("exit_reasons", {}))
        for key in ("model_s", "tool_latency_s", "test_run_s", "episode_s"):
            sums[key] += episodes.get(f"{key}_sum", 0.0)
    keys = ("model_s", "tool_latency_s", "test_run_s")
    parts = sum(sums[k] for k in keys)
    return {"episodes": sum(reasons.values()), "exit_reasons": dict(reasons), "seconds": dict(sums),
            "shares": {k: sums[k] / parts if parts else 0.0 for k in keys}}  # fmt: skip


def resource_shares(timeline: Timeline) -> dict[str, float]:
    """Share of all resource-seconds in each phase."""
    seconds: Counter = Counter()
    for iv in timeline.intervals:
        seconds[str(iv.phase)] += iv.end_s - iv.start_s
    total = sum(seconds.values()) or 1.0
    return {phase: s / total for phase, s in sorted(seconds.items())}


def report(run: Path) -> dict:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timeline = Timeline.load(run / "intervals.json")
    episodes = episode_shares(metrics)
    minutes = timeline.wall_s / 60
    return {"run": str(run), "wall_s": timeline.wall_s, "episodes_per_minute": episodes["episodes"] / minutes,
            **episodes, "resource_shares": resource_shares(timeline)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, default=None, help="a finished swe training run's folder")
    parser.add_argument("--steps", type=int, default=3, help="steps of the short run made without --run")
    parser.add_argument("--sandbox", default="docker", choices=("docker", "local"))
    parser.add_argument("--agent", default="builtin")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-swe-") as tmp:
        run = args.run
        if run is None:
            run = Path(tmp) / "run"
            make_run(run, args.steps, args.sandbox, args.agent)
        r = report(run)
    print(f"SWE training run {r['run']}: {r['episodes']} training episodes in {r['wall_s']:.0f} s of RL "
          f"= {r['episodes_per_minute']:.1f} episodes/min; exit reasons {r['exit_reasons']}")  # fmt: skip
    s = r["shares"]
    print(f"episode time: generating (model_s) {s['model_s']:.0%}, sandbox tools (tool_latency_s) "
          f"{s['tool_latency_s']:.0%}, test runs (test_run_s) {s['test_run_s']:.0%}")  # fmt: skip
    print("resource time: " + ", ".join(f"{phase} {share:.0%}" for phase, share in r["resource_shares"].items()))
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
