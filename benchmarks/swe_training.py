"""Where does the time of SWE training go? Episodes per minute, and the shares of generating, sandboxes and training.

Reads a finished `python -m reference train` run of the swe task (`--run DIR`, e.g. `make train-swe`'s output), or
first makes a short one in a temporary folder (`make bench-swe`: no warm start, `--steps` GRPO steps of
`--prompts` tasks x `--group-size` episodes, `--max-turns` model calls of at most `--max-tokens` tokens an
episode, the built-in agent in Docker sandboxes; the first `--train-tasks` tasks of the shipped suite's train
split and one held-out task, so the evaluations at the start and the end of RL stay short), and prints:

- episodes per minute of the RL run: training episodes over the timeline's wall time (the evaluations at the
  start and the end are outside it; those of `run.eval_every_steps` run beside it and are not counted);
- of the episodes' own wall time (summed over episodes, so concurrent episodes each count), the shares spent
  waiting for the model (`model_s`: generation, queueing and weight syncs included), in the sandbox: the agent's
  commands and the final diff (`tool_latency_s`), grading (`test_run_s`: a sandbox, the patch applied, the tests
  run), and the rest (`other`: the agent's own work, its wait for its workspace to start); the first three are
  named as the simulator's SWE workload names them. Apart: the share spent blocked on a container's start
  (`sandbox_wait_s`, the workspace's in `other` and the grader's in `test_run_s`);
- of the sandbox lanes' occupied time (the timeline's `sandboxes`: one container at a time a lane), the shares
  each phase held (`start`, `spare`, `model`: the agent waiting for the model, `tool`, `test_run`);
- of each resource's wall time (the run's timeline), by pool: rollout-only resources generating or idle (no
  request in flight: every episode is in its sandbox, or the policy holds rollout back for a step), train
  resources training, syncing weights, generating (the tag policy lends them to rollout) or idle.

A random model (no warm start) never finishes its turns early, so each model call runs to `--max-tokens`: the
generating share is the upper end of what a trained model's episodes show. Its episodes all end at the turn limit;
the short run trains their tokens (`overlong: train`), so each step costs the trainer what a step of finished
episodes would.

    python -m benchmarks.swe_training [--run DIR] [--steps 2] [--sandbox docker|local] [--warm-start-steps 0]
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

REPO = Path(__file__).resolve().parents[1]
PARTS = ("model_s", "tool_latency_s", "test_run_s")  # an episode's time, as the simulator's SWE workload names it


def task_files(folder: Path, train_tasks: int) -> list[str]:
    """The first `train_tasks` tasks of the shipped train split and one held-out task, as task files in `folder`
    (the `--set` items that point the run at them)."""
    from swebench_env.suite import load_suite
    from swebench_env.tasks import dump_tasks

    train = dump_tasks(load_suite("train")[:train_tasks], folder / "train.jsonl")
    held_out = dump_tasks(load_suite("held_out")[:1], folder / "held_out.jsonl")
    return [f"task.options.train_tasks={train}", f"task.options.held_out_tasks={held_out}"]


def make_run(out: Path, args: argparse.Namespace) -> None:
    """A short SWE training run in `out` (its own process, as `make train-swe` runs it)."""
    items = [
        f"task.options.sandbox={args.sandbox}",
        f"task.options.agent={args.agent}",
        f"task.options.max_turns={args.max_turns}",
        f"task.options.max_tokens={args.max_tokens}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        "run.eval_every_steps=0",
        f"warm_start.steps={args.warm_start_steps}",
        "task.options.overlong=train",
        *task_files(out.parent / "tasks", args.train_tasks),
    ]
    config = REPO / "reference" / "configs" / "swe.yaml"
    cmd = [
        sys.executable,
        "-m",
        "reference",
        "train",
        "--config",
        str(config),
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--quiet",
    ]
    for item in items:
        cmd += ["--set", item]
    print(
        f"bench-swe: a {args.steps}-step SWE training run ({args.prompts} tasks x {args.group_size} episodes a step, "
        f"{args.sandbox} sandboxes) in {out}",
        file=sys.stderr,
        flush=True,
    )
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL)  # its table is not this benchmark's figures
    if done.returncode != 0:
        raise SystemExit(f"bench-swe: the training run failed (exit {done.returncode}); its error is above")


def last_run(metrics: list[dict]) -> list[dict]:
    """The step records of the timeline's run: those after the last start-of-RL evaluation (a resumed run appends
    to metrics.jsonl; its timeline holds only its own steps)."""
    starts = [i for i, r in enumerate(metrics) if r.get("kind") == "held_out" and r.get("label") == "start"]
    return [r for r in metrics[starts[-1] if starts else 0 :] if r.get("kind") == "step"]


def episode_shares(steps: list[dict]) -> dict:
    """Training episodes, their exit reasons, and the shares of their summed time in each part, from step records
    (`other`: the rest of the episodes' time; `sandbox_wait_s`: apart, it overlaps `test_run_s` and `other`)."""
    reasons: Counter = Counter()
    sums: Counter = Counter()
    for record in steps:
        episodes = record.get("episodes", {})
        reasons.update(episodes.get("exit_reasons", {}))
        for key in (*PARTS, "episode_s", "sandbox_wait_s"):
            sums[key] += episodes.get(f"{key}_sum", 0.0)
    total = max(sums["episode_s"], sum(sums[k] for k in PARTS))
    seconds = {k: sums[k] for k in PARTS} | {"other": total - sum(sums[k] for k in PARTS)}
    return {
        "episodes": sum(reasons.values()),
        "exit_reasons": dict(reasons),
        "episode_s": total,
        "seconds": seconds,
        "shares": {k: s / total if total else 0.0 for k, s in seconds.items()},
        "sandbox_wait_share": sums["sandbox_wait_s"] / total if total else 0.0,
    }


def pool_shares(timeline: Timeline) -> dict[str, dict[str, float]]:
    """Share of each pool's resource-seconds in each phase; pools: `train` (train-capable resources) and
    `rollout` (rollout-only ones)."""
    seconds: dict[str, Counter] = {}
    for iv in timeline.intervals:
        pool = "train" if "train" in iv.tags else "rollout"
        seconds.setdefault(pool, Counter())[str(iv.phase)] += iv.end_s - iv.start_s
    out = {}
    for pool, phases in sorted(seconds.items()):
        total = sum(phases.values()) or 1.0
        out[pool] = {phase: s / total for phase, s in phases.most_common()}
    return out


def lane_shares(timeline: Timeline) -> dict[str, float]:
    """Share of the sandbox lanes' occupied seconds in each phase ({} where the run drew no lanes)."""
    seconds: Counter = Counter()
    for sb in timeline.sandboxes:
        seconds[str(sb.phase)] += sb.end_s - sb.start_s
    total = sum(seconds.values())
    return {phase: s / total for phase, s in seconds.most_common()} if total else {}


def report(run: Path) -> dict:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines if line.strip()]
    timeline = Timeline.load(run / "intervals.json")
    episodes = episode_shares(last_run(metrics))
    per_minute = episodes["episodes"] / (timeline.wall_s / 60) if timeline.wall_s > 0 else 0.0
    return {
        "run": str(run),
        "wall_s": timeline.wall_s,
        "episodes_per_minute": per_minute,
        **episodes,
        "lanes": len({sb.lane for sb in timeline.sandboxes}),
        "lane_shares": lane_shares(timeline),
        "pools": pool_shares(timeline),
    }


def lines(r: dict) -> list[str]:
    """The figures, as `make bench-swe` prints them."""
    s = r["shares"]
    sandbox = s["tool_latency_s"] + s["test_run_s"]
    out = [
        f"SWE training: {r['episodes']} training episodes in {r['wall_s']:.0f} s of RL = "
        f"{r['episodes_per_minute']:.1f} episodes/min (exit reasons: {r['exit_reasons']})",
        f"episode time ({r['episode_s']:.0f} s summed over episodes): generating (waiting for the model) "
        f"{s['model_s']:.0%}, in sandboxes {sandbox:.0%} (commands {s['tool_latency_s']:.0%}, test runs "
        f"{s['test_run_s']:.0%}), other {s['other']:.0%} (the agent, its wait for its workspace); blocked on a "
        f"container's start {r['sandbox_wait_share']:.0%} (in test runs and other)",
    ]
    if r["lane_shares"]:
        parts = ", ".join(f"{phase} {share:.0%}" for phase, share in r["lane_shares"].items())
        out.append(f"sandbox lanes ({r['lanes']}, occupied time): {parts}")
    names = {"rollout": "generating", "train": "training", "sync": "syncing weights", "switch": "switching"}
    for pool, phases in r["pools"].items():
        parts = ", ".join(f"{names.get(phase, phase)} {share:.0%}" for phase, share in phases.items())
        out.append(f"wall time of the {pool}{'-only' if pool == 'rollout' else ''} resources: {parts}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, default=None, help="a finished swe training run's folder")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps of the short run made without --run")
    parser.add_argument("--prompts", type=int, default=4, help="tasks a step")
    parser.add_argument("--group-size", type=int, default=2, help="episodes a task")
    parser.add_argument("--max-turns", type=int, default=4, help="model calls an episode")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens a model call may generate")
    parser.add_argument("--train-tasks", type=int, default=2, help="tasks of the train split the run draws from")
    parser.add_argument("--warm-start-steps", type=int, default=0, help="supervised steps on demonstrations first")
    parser.add_argument("--sandbox", default="docker", choices=("docker", "local"))
    parser.add_argument("--agent", default="builtin")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-swe-") as tmp:
        run = args.run
        if run is None:
            run = Path(tmp) / "run"
            make_run(run, args)
        r = report(run)
    print("\n".join(lines(r)))
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
