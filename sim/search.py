"""`python -m sim search`: which layout and policy to run a model, cluster and workload with.

    python -m sim search --config FILE [--space KEY=V1,V2,...]... [--policies tag,async] [--jobs N]
                         [--max-candidates 100] [--steps N] [--out DIR]

A candidate is the config (the default, `--config` merged over it, then `--set`) with one value of every
searched key and one policy. The default space is the pool split (`pools.train_fraction`), the rollout
engines' tensor parallelism (`rollout.tensor_parallel`), the trainer's tensor and pipeline parallelism
and the engines' concurrency (`rollout.max_num_seqs`), crossed with every policy; `--space KEY=...`
replaces or adds a key (any config key: `train.mini_batches=1,4`), `--space KEY=` removes one. Keys a
policy ignores are not varied for it (colocated has no pool split), so no layout is run twice.

A layout that cannot run (the model does not fit, a parallel size does not divide a node, too few
resources for a policy) is pruned before anything is simulated; the reasons are counted, with their
numbers blanked so that alike reasons add up. The rest run in `--jobs` processes, each a full
simulation of `num_steps` steps (`--steps` shortens them all alike; the seed is the config's, so
candidates see the same samples). More candidates than `--max-candidates` are sampled, seeded.

Output: the table of candidates on the Pareto front of token throughput against staleness (mean
trained-token lag: lower is more on-policy), then the fastest others; `search.json` (every candidate,
its overrides, figures or pruning reason), `pareto.png` (throughput against lag, one colour per policy,
the front joined) and `best.yaml` (the fastest layout as a config: `python -m sim --config
DIR/best.yaml --policy NAME` reruns it).

Heterogeneous clusters (`cluster.rollout_pool`, e.g. `--config sim/configs/hetero.yaml --space
cluster.rollout_pool.num_gpus=16,32,64`): the devices make the pool split, so `pools.train_fraction` is
not varied. Priced clusters (`cluster.price_per_gpu_hour`): the table gains a cost per million trained
tokens and the front is over three figures, cheaper counting as better too; on one cluster that cost is
price / throughput and the front is the same as without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tqdm import tqdm

from core import config as cfgio
from core.cli import add_config_args, add_out_args, run_main
from core.errors import UserError
from core.outputs import default_out, prepare_out, show_progress
from core.policies import POLICIES
from sim.config import DEFAULT_CONFIG, SimConfig, config_dict, load_config, merged_note, resolve

DEFAULT_SPACE: dict[str, list] = {  # 78 candidates with the five policies; add train.tensor_parallel=1,8 etc.
    "pools.train_fraction": [0.25, 0.5, 0.75],
    "rollout.tensor_parallel": [2, 4, 8],
    "rollout.max_num_seqs": [256, 512],
}
# Keys a policy does not read: not varied for it (one candidate instead of several identical ones).
IGNORED_BY = {"colocated": {"pools.train_fraction"}}
IGNORED_BY_MIXED = {"pools.train_fraction"}  # with cluster.rollout_pool the devices split the pools
COST = "cost_per_million_tokens"  # a priced run's figure (core.metrics.summarize)
SHOWN = 12  # rows of the table besides the Pareto front


@dataclass
class Candidate:
    index: int
    policy: str
    overrides: dict[str, object]
    summary: dict | None = None  # the run's figures (core.metrics.summarize), None if pruned or failed
    pruned: str | None = None  # why it cannot run
    run_s: float = 0.0
    pareto: bool = field(default=False)

    def settings(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.overrides.items()]

    def to_json(self) -> dict:
        s = self.summary
        figures = None
        if s is not None:
            figures = {
                "token_throughput": s["token_throughput"],
                "mean_lag": s["staleness"]["mean_lag"],
                "max_lag": s["staleness"]["max_lag"],
                "bubble_fraction": s["bubble_fraction"],
                "step_time_mean_s": s["step_time_s"]["mean"],
                "wall_s": s["wall_s"],
            }
            if COST in s:
                figures[COST] = s[COST]
        return {
            "index": self.index,
            "policy": self.policy,
            "overrides": self.overrides,
            "figures": figures,
            "pareto": self.pareto,
            "pruned": self.pruned,
            "run_s": round(self.run_s, 3),
        }


def parse_space(items: list[str]) -> dict[str, list]:
    """The default space with `KEY=V1,V2` items applied (`KEY=` removes the key); values parsed as YAML."""
    space = {k: list(v) for k, v in DEFAULT_SPACE.items()}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or "." not in key:
            raise UserError(f"--space {item!r} must look like section.key=v1,v2,... (e.g. rollout.tensor_parallel=2,4)")
        if not raw.strip():
            space.pop(key, None)
            continue
        values = [yaml.safe_load(v) for v in raw.split(",") if v.strip()]
        if len(set(map(repr, values))) != len(values):
            raise UserError(f"--space {key}: a value appears twice in {raw!r}")
        space[key] = values
    return space


def candidates(space: dict[str, list], policies: list[str]) -> list[Candidate]:
    """Every (policy, layout) pair, without the layouts a policy cannot tell apart."""
    out: list[Candidate] = []
    for policy in policies:
        keys = [k for k in space if k not in IGNORED_BY.get(policy, set())]
        for values in itertools.product(*(space[k] for k in keys)):
            out.append(Candidate(len(out), policy, dict(zip(keys, values, strict=True))))
    return out


def _blank_numbers(reason: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", reason)


def _prepare(config: list[str] | None, overrides: list[str], cand: Candidate, steps: int | None):
    """The candidate's Simulation, or a UserError saying why it cannot run (nothing is simulated)."""
    from sim.runner import Simulation

    extra = [*overrides, *cand.settings(), *([f"num_steps={steps}"] if steps else [])]
    cfg = load_config(config, extra)
    return cfg, Simulation.from_config(cfg, cand.policy, progress=False)


def _run(job: tuple[list[str] | None, list[str], Candidate, int | None]) -> Candidate:
    """In a worker process: prune or simulate one candidate."""
    from core.metrics import summarize

    config, overrides, cand, steps = job
    start = time.perf_counter()
    try:
        _, sim = _prepare(config, overrides, cand, steps)
        cand.summary = summarize(sim.run())
    except UserError as e:
        cand.pruned = str(e)
    cand.run_s = time.perf_counter() - start
    return cand


def _cost(c: Candidate) -> float:
    """A priced candidate's cost per million trained tokens (0 unpriced: then cost decides nothing)."""
    return c.summary.get(COST, 0.0)


def pareto(cands: list[Candidate]) -> list[Candidate]:
    """Candidates no other beats on throughput (higher), mean lag (lower) and, when priced, cost per
    token (lower): no other at least as good on all and better on one. Fastest first."""
    ran = [c for c in cands if c.summary is not None]
    ran.sort(key=lambda c: (-c.summary["token_throughput"], c.summary["staleness"]["mean_lag"], _cost(c), c.index))
    front: list[Candidate] = []
    for c in ran:  # by falling throughput: on the front iff no faster one on it has lag and cost as low
        lag, cost = c.summary["staleness"]["mean_lag"], _cost(c)
        if not any(f.summary["staleness"]["mean_lag"] <= lag and _cost(f) <= cost for f in front):
            front.append(c)
    for c in front:
        c.pareto = True
    return front


_ABBREVIATIONS = {
    "tensor_parallel": "tp",
    "pipeline_parallel": "pp",
    "max_num_seqs": "seqs",
    "pools.train_fraction": "train_frac",
    "cluster.rollout_pool.": "rollout_pool.",
}


def label(key: str) -> str:
    """A short column label for a config key: rollout.tensor_parallel -> rollout.tp."""
    for long, short in _ABBREVIATIONS.items():
        key = key.replace(long, short)
    return key


def table(cands: list[Candidate], keys: list[str]) -> str:
    """The Pareto front and the fastest others, fastest first; `keys`: the columns (the searched keys)."""
    ran = sorted((c for c in cands if c.summary), key=lambda c: -c.summary["token_throughput"])
    shown = [c for c in ran if c.pareto] + [c for c in ran if not c.pareto][:SHOWN]
    shown.sort(key=lambda c: -c.summary["token_throughput"])
    priced = bool(shown) and all(COST in c.summary for c in shown)
    head = ["", "policy", *map(label, keys), "tok/s", "mean lag", "max lag", "bubble", "step s"]
    head += ["cost/Mtok"] if priced else []
    rows = []
    for c in shown:
        s = c.summary
        rows.append(
            [
                "*" if c.pareto else "",
                c.policy,
                *(str(c.overrides.get(k, "-")) for k in keys),
                f"{s['token_throughput']:,.0f}",
                f"{s['staleness']['mean_lag']:.2f}",
                str(s["staleness"]["max_lag"]),
                f"{s['bubble_fraction']:.1%}",
                f"{s['step_time_s']['mean']:.1f}",
                *([f"{s[COST]:,.2f}"] if priced else []),
            ]
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    numeric = len(head) - (6 if priced else 5)  # the figures: right-aligned

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.rjust(w) if i >= numeric else c.ljust(w) for i, (c, w) in pairs)

    return "\n".join(line(r) for r in [head, *rows])


def draw(cands: list[Candidate], path: Path, title: str, keys: list[str]) -> None:
    """pareto.png: every layout's throughput against its mean lag, one colour per policy, the front joined and
    its layouts numbered and listed (by the searched `keys`)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [c for c in cands if c.summary]
    fig, ax = plt.subplots(figsize=(8, 5))
    policies = list(dict.fromkeys(c.policy for c in ran))
    colours = dict(zip(policies, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for p in policies:
        xs = [c.summary["staleness"]["mean_lag"] for c in ran if c.policy == p]
        ys = [c.summary["token_throughput"] for c in ran if c.policy == p]
        ax.scatter(xs, ys, s=28, alpha=0.75, color=colours.get(p), label=p)
    front = sorted((c for c in ran if c.pareto), key=lambda c: c.summary["staleness"]["mean_lag"])
    if front:
        xs = [c.summary["staleness"]["mean_lag"] for c in front]
        ys = [c.summary["token_throughput"] for c in front]
        ax.plot(xs, ys, color="black", lw=1.2, ls="--", zorder=0, label="Pareto front")
        ax.scatter(xs, ys, s=90, facecolors="none", edgecolors="black", lw=1.2)
        names = []
        for n, (c, x, y) in enumerate(zip(front[::-1], xs[::-1], ys[::-1], strict=True), 1):  # fastest is 1
            ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(7, 4), fontsize=8, fontweight="bold")
            varied = " ".join(f"{label(k)}={v}" for k, v in c.overrides.items() if k in keys)
            cost = f" ({c.summary[COST]:,.2f}/Mtok)" if COST in c.summary else ""
            names.append(f"{n}: {c.policy} {varied}".strip() + cost)
        ax.text(
            0.99,
            0.02,
            "Pareto front (fastest first)\n" + "\n".join(names),
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            multialignment="left",
            fontsize=7.5,
            family="monospace",
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "0.7"},
        )
    ax.set_xlabel("mean trained-token lag (policy versions; lower is more on-policy)")
    ax.set_ylabel("token throughput (tok/s)")
    ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    ax.margins(x=0.12, y=0.08)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sim search", description=__doc__.split("\n")[0])
    add_config_args(
        p,
        default_config="sim/configs/default.yaml",
        example="cluster.num_gpus=128",
        what="a config key for every candidate",
        note="; a chosen workload.kind brings its own defaults first",
    )
    p.add_argument(
        "--space",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="search these values of a config key (repeatable; KEY= drops a default key)",
    )
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated (default: {','.join(POLICIES)})")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: one per core)")
    p.add_argument("--max-candidates", type=int, default=100, help="sample this many when the space is larger")
    p.add_argument("--steps", type=int, default=None, help="steps per candidate (default: the config's num_steps)")
    add_out_args(p, default="results/search-layouts-<time>-seed<seed>")
    p.add_argument("--no-picture", action="store_true", help="skip pareto.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: _search(args))


def _search(args: argparse.Namespace) -> int:
    for name, value, lowest in (
        ("--jobs", args.jobs, 1),
        ("--max-candidates", args.max_candidates, 1),
        ("--steps", args.steps or 1, 1),
    ):
        if value < lowest:
            raise UserError(f"{name} must be >= {lowest}, got {value}")
    data, files = resolve(args.config, args.overrides)  # a bad base config fails here, once
    base = cfgio.from_dict(SimConfig, data)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if unknown := [p for p in policies if p not in POLICIES]:
        raise UserError(f"unknown policy {unknown[0]!r}; valid choices: {', '.join(POLICIES)}")
    space = parse_space(args.space)
    known = config_dict(base)
    for key in space:  # an unknown key is the user's typo: one line before anything runs
        node = known
        for i, part in enumerate(parts := key.split(".")):
            if not isinstance(node, dict) or part not in node:
                where = ".".join(parts[:i]) or "the config"
                choices = ", ".join(node) if isinstance(node, dict) else "none (not a section)"
                raise UserError(f"--space: unknown config key {key!r}; valid keys in {where}: {choices}")
            node = node[part]
    if base.cluster.rollout_pool is not None:  # the devices split the pools: nothing to vary there
        space = {k: v for k, v in space.items() if k not in IGNORED_BY_MIXED}
    cands = candidates(space, policies)
    total = len(cands)
    if total > args.max_candidates:
        cands = sorted(random.Random(base.seed).sample(cands, args.max_candidates), key=lambda c: c.index)
    out = prepare_out(args.out, default_out("search", "layouts", base.seed), args.overwrite)
    print(merged_note(files), file=sys.stderr)  # every input checked: an error stays one line
    jobs = [(args.config, args.overrides, c, args.steps) for c in cands]
    start = time.perf_counter()
    bar = tqdm(total=len(jobs), desc="candidates", unit="run", disable=not show_progress(not args.quiet))
    done: list[Candidate] = []
    if args.jobs == 1:
        for job in jobs:
            done.append(_run(job))
            bar.update()
    else:
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs))) as pool:
            for cand in pool.map(_run, jobs, chunksize=1):
                done.append(cand)
                bar.update()
    bar.close()
    wall = time.perf_counter() - start
    front = pareto(done)
    keys = [k for k, values in space.items() if len(values) > 1]  # the columns: what varies
    pruned = Counter(_blank_numbers(c.pruned) for c in done if c.pruned)
    ran = [c for c in done if c.summary]
    print(
        f"{base.model} | {base.workload.kind} | {base.cluster_label} | "
        f"{args.steps or base.num_steps} steps | seed {base.seed}"
    )
    sampled = f" (sampled from {total})" if total > len(done) else ""
    print(
        f"{len(done)} candidates{sampled}: {len(ran)} ran, {len(done) - len(ran)} pruned; {wall:.1f} s with "
        f"{args.jobs} process(es)"
    )
    for reason, n in pruned.most_common():
        print(f"  pruned {n:>3}: {reason}")
    given = args.config or [str(DEFAULT_CONFIG)]
    given = given[0] if len(given) == 1 else given
    summary = {
        "config": given,
        "overrides": args.overrides,
        "space": space,
        "policies": policies,
        "candidates_in_space": total,
        "wall_s": round(wall, 3),
        "pruned": dict(pruned.most_common()),
        "candidates": [c.to_json() for c in done],
    }
    (out / "search.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not ran:
        print(f"no candidate can run; outputs: {out}/")
        return 1
    against = " and cost" if any(COST in c.summary for c in ran) else ""
    print(f"\n* = on the Pareto front of throughput against staleness{against}")
    print(table(done, keys))
    best = front[0]
    cfg, _ = _prepare(args.config, args.overrides, best, args.steps)
    (out / "best.yaml").write_text(
        f"# python -m sim --config {out / 'best.yaml'} --policy {best.policy}\n"
        + yaml.safe_dump(config_dict(cfg), sort_keys=False)
    )
    if not args.no_picture:
        title = f"layout search: {base.model}, {base.workload.kind}, {base.cluster_label} ({len(ran)} layouts)"
        draw(done, out / "pareto.png", title, keys)
    varied = " ".join(f"{k}={v}" for k, v in best.overrides.items() if k in keys) or "the config as is"
    figures = best.summary["token_throughput"], best.summary["staleness"]["mean_lag"]
    print(f"\nfastest: {best.policy} with {varied}: {figures[0]:,.0f} tok/s, mean lag {figures[1]:.2f}")
    print(f"rerun it: python -m sim --config {out / 'best.yaml'} --policy {best.policy}")
    print(f"outputs: {out}/")
    return 0
