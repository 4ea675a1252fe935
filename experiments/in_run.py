"""The parts inside the runtime's runs against the same parts measured alone, for `experiments.validate`: the
trainer's seconds a step in each run over what its round's part predicts for that step's own sequences
(`trainer_in_run`), and the SWE runs' sandbox seconds an episode against the sandbox part (`sandboxes_in_run`).
Both read the runs' outputs (metrics.jsonl, the trajectory store).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from experiments.comparison import runs_of
from experiments.validate_setup import round_dir, run_dir


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
