"""Sensitivity: when does tag's token throughput approach 2x colocated, and why does it miss?

Six one-at-a-time sweeps around the default config, each run for colocated, async, tag and streaming
on the same seed (colocated is re-run only where the swept key affects it; otherwise its default run is the
baseline, i.e. a flat line at 1.0):

    a. workload.response_tokens.sigma   response-length tail (log-normal sigma; default 0.8)
    b. pools.train_fraction             share of resources in the train pool (async, tag)
    c. policy.max_staleness             staleness bound of async and tag (default 1); the simulator
                                        restarts samples whose tokens would exceed it, so we also
                                        report the wasted-token share and the trained response length
    d. workload.response_tokens.max     the response-length cap (default 16384): with sigma 0.8 the
                                        longest of 2048 responses almost always hits it, so the cap,
                                        not sigma, sets colocated's straggler time
    e. workload.prompts_per_step        batch size against the cluster (default 128 x 16 responses
                                        on 64 GPUs): a bigger batch amortises colocated's straggler
                                        wait over more useful decoding
    f. workload.response_tokens.median  toward long reasoning: the median response from 1.25k to 8k
                                        tokens with the cap at 32k for every point (8k is the median of
                                        sim/configs/long_reasoning.yaml)

    python -m experiments.sensitivity                  # 93 runs, about 3 minutes on 2 cores
    python -m experiments.sensitivity --steps 10 --out /tmp/sens10   # half the time

Runs use `--steps` training steps, by default 20 like the headline, so the default point of every
sweep is exactly the headline run. With 10 steps the study takes half the time, but the ratios of
async and tag come out 0.00-0.06 lower, and tag's at max_staleness >= 2 0.08-0.09 lower: the
pipelined policies pay their fill-up in the first step, which weighs more in a short run.

Writes, in `--out` (default experiments/out/sensitivity): sensitivity.json (rows and full
summaries), sensitivity.csv (the rows), config.yaml (the resolved base config) and sensitivity.png
(one cell per sweep, three to a row; in each, on top: throughput ratio to colocated; below: tag's
wasted-token share and how much shorter its trained responses are than colocated's, which shows the
bias against long responses).
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path

from core.cli import add_config_args, run_main
from core.policies.base import split_pools
from experiments._common import (
    NO_STAMP,
    PAPER_RATIO,
    run_policy,
    save_config,
    save_json,
    source_fingerprint,
    wasted_share,
)
from sim.config import SimConfig, config_dict, load_config

BASELINE = "colocated"
COMPARED = ("async", "tag", "streaming")
STYLE = {"tag": ("#1f77b4", "-", "o"), "async": ("#ff7f0e", "--", "s"), "streaming": ("#2ca02c", "-.", "^")}


@dataclass(frozen=True)
class Sweep:
    key: str
    values: tuple[float, ...]
    label: str
    baseline_uses_key: bool  # False: colocated ignores the key, so its default run is the baseline
    fixed: tuple[str, ...] = ()  # overrides every point of the sweep shares (the baseline's included)


SWEEPS = {
    "sigma": Sweep(
        "workload.response_tokens.sigma",
        (0.0, 0.3, 0.6, 0.8, 1.0, 1.2),
        "response-length sigma (log-normal tail)",
        True,
    ),
    "train_fraction": Sweep(
        "pools.train_fraction", (0.25, 0.375, 0.5, 0.625, 0.75), "train pool share of resources", False
    ),
    "max_staleness": Sweep("policy.max_staleness", (0, 1, 2, 4), "staleness bound (policy versions)", False),
    "response_max": Sweep(
        "workload.response_tokens.max", (4096, 8192, 16384, 32768), "response-length cap (tokens)", True
    ),
    "batch": Sweep("workload.prompts_per_step", (32, 64, 128, 256, 512), "prompts per step (x 16 responses)", True),
    "long": Sweep(
        "workload.response_tokens.median",
        (1250, 2500, 5000, 8000),
        "response-length median (tokens; cap 32k)",
        True,
        ("workload.response_tokens.max=32768",),
    ),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.sensitivity", description=__doc__.splitlines()[0])
    add_config_args(
        p, default_config="sim/configs/default.yaml", example="cluster.num_gpus=128", what="a key of the base config"
    )
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    p.add_argument("--sweeps", default=",".join(SWEEPS), help=f"comma-separated subset of: {', '.join(SWEEPS)}")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--out", default="experiments/out/sensitivity", help="output folder")
    args = p.parse_args(argv)
    args.sweeps = args.sweeps.split(",")
    unknown = [s for s in args.sweeps if s not in SWEEPS]
    if unknown:
        p.error(f"unknown sweep {unknown[0]!r}; valid choices: {', '.join(SWEEPS)}")
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, float, str, tuple[str, ...]]]:
    """(sweep, value, policy, overrides) for every point; overrides include the base ones."""
    base = (*args.overrides, f"num_steps={args.steps}")
    points = []
    for name in args.sweeps:
        sweep = SWEEPS[name]
        for value in sweep.values:
            own = (*base, *sweep.fixed, f"{sweep.key}={value}")
            points.append((name, value, BASELINE, own if sweep.baseline_uses_key else (*base, *sweep.fixed)))
            points += [(name, value, policy, own) for policy in COMPARED]
    return points


def _job(job: tuple[SimConfig, str]) -> dict:
    return run_policy(*job)


def run_all(args: argparse.Namespace, points: list) -> tuple[dict[str, dict], dict[str, SimConfig], list[str]]:
    """Simulate each distinct (resolved config, policy) once, in parallel. Configs are resolved here,
    so workers run exactly what is saved. Returns summaries and configs by run name
    ("policy|overrides"), and each point's run name."""
    names, jobs = [], {}
    for _, _, policy, overrides in points:
        cfg = load_config(args.config, list(overrides))
        key = (policy, json.dumps(config_dict(cfg), sort_keys=True))
        jobs.setdefault(key, (f"{policy}|{' '.join(overrides)}", cfg, policy))
        names.append(jobs[key][0])
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        results = pool.map(_job, [(cfg, policy) for _, cfg, policy in jobs.values()], chunksize=1)
    print(f"{len(jobs)} distinct runs for {len(points)} points")
    summaries = {name: s for (name, _, _), s in zip(jobs.values(), results, strict=True)}
    return summaries, {name: cfg for name, cfg, _ in jobs.values()}, names


def train_pool_share(cfg: SimConfig, policy: str) -> float:
    """Share of the cluster's devices that can train under `policy` (colocated: all of them)."""
    if policy == BASELINE:
        return 1.0
    rollout, train = split_pools(cfg.num_resources, cfg.pools.train_fraction, cfg.rollout.tensor_parallel)
    return len(train) / (len(rollout) + len(train))


def make_rows(points: list, run_ids: list[str], summaries: dict[str, dict], cfgs: dict[str, SimConfig]) -> list[dict]:
    by_point = {(sw, v, pol): summaries[rid] for (sw, v, pol, _), rid in zip(points, run_ids, strict=True)}
    rows = []
    for (sweep, value, policy, _), rid in zip(points, run_ids, strict=True):
        s, base = summaries[rid], by_point[(sweep, value, BASELINE)]
        rows.append(
            {
                "sweep": sweep,
                "key": SWEEPS[sweep].key,
                "value": value,
                "policy": policy,
                "run": rid,
                "token_throughput": s["token_throughput"],
                "ratio_to_colocated": round(s["token_throughput"] / base["token_throughput"], 4),
                "step_time_mean_s": s["step_time_s"]["mean"],
                "wall_s": s["wall_s"],
                "bubble_fraction": s["bubble_fraction"],
                "wasted_tokens": s["counters"].get("wasted_tokens", 0.0),
                "wasted_share": round(wasted_share(s), 4),
                "trained_response_tokens_mean": s["trained_response_tokens_mean"],
                "length_vs_colocated": round(
                    s["trained_response_tokens_mean"] / base["trained_response_tokens_mean"], 4
                ),
                "rollout_tokens_per_gpu_s": s["rollout_tokens_per_gpu_s"],
                "mean_lag": s["staleness"]["mean_lag"],
                "util_rollout": s["utilisation"]["rollout"],
                "util_train": s["utilisation"]["train"],
                "util_idle": s["utilisation"]["idle"],
                "train_pool_training": round(s["utilisation"]["train"] / train_pool_share(cfgs[rid], policy), 4),
            }
        )
    return rows


def _draw_ratios(ax, rows: list[dict]) -> None:
    for policy in COMPARED:
        pts = [r for r in rows if r["policy"] == policy]
        colour, ls, marker = STYLE[policy]
        xs, ys = [r["value"] for r in pts], [r["ratio_to_colocated"] for r in pts]
        ax.plot(xs, ys, color=colour, linestyle=ls, marker=marker, markersize=4, label=f"{policy} / colocated")
    ax.axhline(1.0, color="#7f7f7f", linewidth=1, label="colocated (1.0)")
    ax.axhline(PAPER_RATIO, color="#d62728", linestyle="--", linewidth=1, label="paper's claim (2x)")
    ax.set_ylim(0, max(2.4, *(r["ratio_to_colocated"] + 0.2 for r in rows)))


def _draw_waste(ax, rows: list[dict]) -> None:
    tag = [r for r in rows if r["policy"] == "tag"]
    xs = [r["value"] for r in tag]
    waste = [100 * r["wasted_share"] for r in tag]
    shorter = [100 * (1 - r["length_vs_colocated"]) for r in tag]
    ax.plot(xs, waste, color="#9467bd", marker="o", markersize=4, label="tag: share of generated tokens wasted")
    ax.plot(
        xs,
        shorter,
        color="#8c564b",
        marker="^",
        markersize=4,
        linestyle=":",
        label="tag: how much shorter its trained\nresponses are than colocated's",
    )
    ax.set_ylim(min(0, *shorter) - 1, max(10, *waste, *shorter) * 1.15)


def _draw_sweep(sub, rows: list[dict], name: str, letter: str, default: float, first_col: bool) -> list:
    """One sweep in its own subfigure: throughput ratios on top, tag's waste below; their axes."""
    top, bottom = sub.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    _draw_ratios(top, rows)
    _draw_waste(bottom, rows)
    top.set_title(f"{letter}. {SWEEPS[name].key}", fontsize=9)
    bottom.set_xlabel(SWEEPS[name].label, fontsize=8)
    top.set_ylabel("throughput / colocated" if first_col else "", fontsize=8)
    bottom.set_ylabel("% (tag)" if first_col else "", fontsize=8)
    for ax in (top, bottom):
        ax.axvline(default, color="#bbbbbb", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if name in ("response_max", "batch", "long"):
            ax.set_xscale("log", base=2)
            labels = {"response_max": lambda v: f"{v / 1024:g}k", "long": lambda v: f"{v / 1000:g}k"}.get(
                name, lambda v: str(int(v))
            )
            labels = [labels(v) for v in SWEEPS[name].values]
            ax.set_xticks(SWEEPS[name].values, labels)
            ax.minorticks_off()
    return [top, bottom]


def draw(rows: list[dict], sweeps: list[str], defaults: dict[str, float], title: str, path: Path) -> None:
    """A grid of sweeps, three to a row (readable at 900 px wide), with the legends in the next cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The legend takes a spare cell of the grid, or goes below it when the sweeps fill every row.
    spare = len(sweeps) % 3 != 0 or len(sweeps) < 3
    cols = min(3, len(sweeps) + spare)
    grid_rows = -(-(len(sweeps) + spare) // cols)
    fig = plt.figure(figsize=(9.0, 3.9 * grid_rows + (0.3 if spare else 1.2)), layout="constrained")
    cells = fig.subfigures(grid_rows, cols, squeeze=False).flatten()
    for i, name in enumerate(sweeps):
        mine = [r for r in rows if r["sweep"] == name]
        axes = _draw_sweep(cells[i], mine, name, chr(ord("a") + i), defaults[name], i % cols == 0)
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    handles.append(plt.Line2D([], [], color="#bbbbbb", linestyle=":", label="the default value"))
    if spare:
        cells[len(sweeps)].legend(handles=handles, loc="center", fontsize=8, frameon=False)
    else:
        fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=150, metadata=NO_STAMP)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    lines = [
        f"{'sweep':<15}{'value':>8}  {'async x':>8}{'tag x':>7}{'strm x':>8}{'tag waste':>10}{'tag len':>8}"
        f"{'coloc gen':>10}{'tag T-pool':>11}"
    ]
    keyed = {(r["sweep"], r["value"], r["policy"]): r for r in rows}
    for sweep, value in dict.fromkeys((r["sweep"], r["value"]) for r in rows):
        a, t, st, c = (keyed[(sweep, value, p)] for p in ("async", "tag", "streaming", BASELINE))
        lines.append(
            f"{sweep:<15}{value:>8g}  {a['ratio_to_colocated']:>7.2f}x{t['ratio_to_colocated']:>6.2f}x"
            f"{st['ratio_to_colocated']:>7.2f}x"
            f"{t['wasted_share']:>10.1%}{t['length_vs_colocated']:>8.2f}{c['util_rollout'] + c['util_idle']:>10.1%}"
            f"{t['train_pool_training']:>11.1%}"
        )
    lines.append(
        "x: token throughput / colocated; tag len: trained response length / colocated's;\n"
        "coloc gen: colocated device time generating or idle;\n"
        "tag T-pool: tag train-pool time spent training"
    )
    return "\n".join(lines)


def base_value(cfg: SimConfig, key: str) -> float:
    node = config_dict(cfg)
    for part in key.split("."):
        node = node[part]
    return node


def write_data(out: Path, args: argparse.Namespace, source: str, rows: list[dict], summaries: dict) -> None:
    sweeps = {n: {"key": SWEEPS[n].key, "values": list(SWEEPS[n].values)} for n in args.sweeps}
    data = {"steps": args.steps, "overrides": args.overrides, "source": source, "sweeps": sweeps}
    save_json({**data, "rows": rows, "summaries": summaries}, out / "sensitivity.json")
    with (out / "sensitivity.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "run"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: sensitivity(args))


def sensitivity(args: argparse.Namespace) -> int:
    source = source_fingerprint()  # before running: the sources as imported
    cfg = load_config(args.config, [*args.overrides, f"num_steps={args.steps}"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = plan(args)
    summaries, cfgs, run_ids = run_all(args, points)
    rows = make_rows(points, run_ids, summaries, cfgs)
    save_config(cfg, out / "config.yaml")
    write_data(out, args, source, rows, summaries)
    title = (
        f"{cfg.model}, {cfg.workload.kind}, {cfg.cluster.num_gpus} x {cfg.cluster.device}, "
        f"{cfg.num_steps} steps per run, seed {cfg.seed}"
    )
    defaults = {name: base_value(cfg, SWEEPS[name].key) for name in args.sweeps}
    draw(rows, args.sweeps, defaults, title, out / "sensitivity.png")
    print(title)
    print(table(rows))
    print(f"outputs: {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
