"""The simulator's SWE workload, measured from this runtime's episodes (`sim/configs/swe.yaml`'s keys).

`fit_store(path)` reads a trajectory store, the `trajectories.sqlite` of a `python -m reference train --task
swe` run or the `demonstrations.sqlite` of `SweTask.demonstrations`, and fits each length the simulator
draws (`sim.config.Dist`: a log-normal, median x exp(sigma x N(0, 1)), clipped to [min, max]) by maximum
likelihood: the median is the geometric mean, sigma the standard deviation of the logarithms, min and max
the extremes seen. An episode is what a group record's `meta.episodes` names (its session and requests; its
exit reason is counted); a store without group records (demonstrations) is one episode a session. Per
episode: `turns` is its requests, `prompt_tokens` its first request's prompt (system prompt, task statement,
tool descriptions), `response_tokens` each request's generated tokens, `tool_output_tokens` what each later
request's prompt adds to the previous request's whole sequence (the command's output and the chat
template's tokens around it; a request that rewrote the history is skipped).

The store holds no sandbox time, so `time_episodes` measures it apart: each demonstration's commands run in
order in the task's workspace (`tool_latency_s`: every command but the final submit, whose place the test
run takes in the simulator), then the grader runs on the demonstration's patch (`test_run_s`).

`SUITE_WORKLOAD` is the fit shipped for the shipped suite, from `python -m swebench_env.sim_workload
--workdir DIR` (its train split's 32 demonstrations replayed through a manager with the built-in agent and
the project's tokenizer, timed in local checkouts: see the constant). `task_workload(config)` gives the
`workload` keys of a `SweTaskConfig`'s run: that fit, bounded by the task's own limits (turns, tokens a
call, context). Departure: the demonstrations are scripted, 8 steps each, so `turns` has sigma 0 and the
lengths are those of a solving agent; a run's own store gives its policy's distribution.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from swebench_env.suite_workload import SUITE_WORKLOAD


@dataclass(frozen=True)
class EpisodeShape:
    """One episode's lengths, in tokens."""

    prompt_tokens: int  # the first request's prompt
    response_tokens: tuple[int, ...]  # each request's generated tokens
    tool_output_tokens: tuple[int, ...]  # what each later request's prompt adds (rewrites skipped)
    exit_reason: str

    @property
    def turns(self) -> int:
        return len(self.response_tokens)


def fit(values: Iterable[float], integer: bool = True) -> dict:
    """A `sim.config.Dist` (as a mapping) fitted to positive samples: log-normal by maximum likelihood."""
    xs = [float(v) for v in values]
    if not xs or min(xs) <= 0:
        raise ValueError(f"fit needs positive samples, got {len(xs)} with minimum {min(xs, default=None)}")
    logs = [math.log(x) for x in xs]
    median, sigma = math.exp(statistics.fmean(logs)), statistics.pstdev(logs)
    lo, hi = min(xs), max(xs)
    if integer:
        return {"median": round(median, 1), "sigma": round(sigma, 3), "min": int(lo), "max": int(hi)}
    return {"median": _sig(median), "sigma": round(sigma, 3), "min": _sig(lo), "max": _sig(hi)}


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


# ---- lengths from a trajectory store ----


def episode_shapes(store) -> list[EpisodeShape]:
    """Every episode of a `reference.manager.store.TrajectoryStore`, in session order."""
    grouped = _grouped_episodes(store)
    if grouped is None:
        return [_shape(store.records(sid), "finished") for sid in store.sessions() if store.records(sid)]
    out = []
    for sid, request_ids, reason in grouped:
        wanted = set(request_ids)
        records = [r for r in store.records(sid) if r.request_id in wanted]
        if records:
            out.append(_shape(records, reason))
    return out


def _grouped_episodes(store) -> list[tuple[str, list[str], str]] | None:
    """(session, request ids, exit reason) of each episode the group records name, each once; None if none do."""
    seen: dict[str, tuple[str, list[str], str]] = {}
    for sid in store.sessions():
        for e in store.annotations(sid).get("meta", {}).get("episodes", []):
            seen[e["session_id"]] = (e["session_id"], list(e["request_ids"]), e.get("exit_reason", "finished"))
    return list(seen.values()) or None


def _shape(records: Sequence, exit_reason: str) -> EpisodeShape:
    tool = []
    for before, after in zip(records, records[1:], strict=False):
        added = after.prompt_len - (before.prompt_len + len(before.token_ids))
        if added > 0:  # <= 0: the agent rewrote its history; no tool output to read off
            tool.append(added)
    responses = tuple(max(1, len(r.token_ids)) for r in records)
    return EpisodeShape(records[0].prompt_len, responses, tuple(tool), exit_reason)


def fit_store(path: str | Path) -> dict:
    """The token keys of the simulator's `workload` fitted to the store's episodes, with `episodes` (how many)
    and `exit_reasons` (their counts) beside them."""
    return fit_stores([path])


def fit_stores(paths: Sequence[str | Path]) -> dict:
    """`fit_store` over the episodes of several stores together (runs of one workload)."""
    from reference.manager.store import TrajectoryStore

    shapes: list[EpisodeShape] = []
    for path in paths:
        with TrajectoryStore(path) as store:
            shapes += episode_shapes(store)
    if not shapes:
        raise ValueError(f"no episode in the trajectory store(s) {', '.join(repr(str(p)) for p in paths)}")
    tool = [t for s in shapes for t in s.tool_output_tokens]
    return {
        "turns": fit(s.turns for s in shapes),
        "prompt_tokens": fit(s.prompt_tokens for s in shapes),
        "response_tokens": fit(r for s in shapes for r in s.response_tokens),
        "tool_output_tokens": fit(tool) if tool else SUITE_WORKLOAD["tool_output_tokens"],
        "episodes": len(shapes),
        "exit_reasons": dict(Counter(s.exit_reason for s in shapes).most_common()),
    }


# ---- sandbox time, measured apart ----


def time_episodes(
    pairs: Sequence, sandbox: str = "local", image: str | None = None, timeout_s: float = 120.0, environments=None
) -> dict:
    """`tool_latency_s` and `test_run_s` fitted to (task, demonstration) pairs: each demonstration's commands
    timed in order in the task's workspace (its submit step left out), then its patch graded, timed.
    `environments`: a function giving each pair its (workspace, grader) (a pooled run's); else `sandbox`'s."""
    from swebench_env.demos import SUBMIT_COMMAND, SUBMIT_MARKER
    from swebench_env.rollout import environment

    if environments is None:
        pair = environment(sandbox, image)
        environments = lambda: pair  # noqa: E731
    commands, grades = [], []
    for task, demo in pairs:
        workspace, grader = environments()
        with workspace(task) as runner:
            for step in demo.steps[:-1]:
                start = time.monotonic()
                runner.exec(step.command, timeout_s)
                commands.append(time.monotonic() - start)
            patch = runner.exec(SUBMIT_COMMAND, timeout_s).output.partition(SUBMIT_MARKER + "\n")[2]
        start = time.monotonic()
        grader(task, patch)
        grades.append(time.monotonic() - start)
    return {"tool_latency_s": fit(commands, integer=False), "test_run_s": fit(grades, integer=False)}


def measure_suite(workdir: Path, sandbox: str = "local") -> dict:
    """The shipped suite's workload: its train split's demonstrations replayed through a manager into
    `workdir/demonstrations.sqlite` (`SweTask.demonstrations`), fitted, and timed in `sandbox` workspaces."""
    from swebench_env.suite import load_suite_demonstrations
    from swebench_env.training import SweTask

    task = SweTask(sandbox=sandbox)
    try:
        task.demonstrations(workdir)
    finally:
        task.close()
    demos = {d.instance_id: d for d in load_suite_demonstrations("all")}
    pairs = [(t, demos[t.instance_id]) for t in task.instances["train"] if t.instance_id in demos]
    return {"kind": "swe", **fit_store(workdir / "demonstrations.sqlite"), **time_episodes(pairs, sandbox)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swebench_env.sim_workload", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", help="fit this trajectory store's lengths (a run's trajectories.sqlite)")
    p.add_argument("--workdir", help="measure the shipped suite: its demonstrations replayed and timed here")
    p.add_argument("--sandbox", default="local", help="local or docker (with --workdir)")
    args = p.parse_args(argv)
    if (args.store is None) == (args.workdir is None):
        p.error("give one of --store FILE or --workdir DIR")
    result = fit_store(args.store) if args.store else measure_suite(Path(args.workdir), args.sandbox)
    print(yaml.safe_dump({"workload": result}, sort_keys=False, default_flow_style=None), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
