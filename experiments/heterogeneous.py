"""Heterogeneous clusters: beside 32 H800 trainers, is a rollout pool of cheaper H20s worth it?

SeamlessFlow's tags let rollout-only resources be of another device type than the trainers. The H20
(core/specs/devices.yaml) has more and faster HBM than the H800 (96 GB at 4.0 TB/s against 80 GB at
3.35) but a seventh of its bf16 compute (148 TFLOPS against 989), and costs less. On the default
model and workload (Qwen3-32B, math, 20 steps, seed 0) three clusters keep the same 32 train-capable
H800 and differ only in their rollout-only pool:

    mixed            32 H20                 (sim/configs/hetero.yaml)
    same GPU count   32 H800                (the default config's 64 H800, split in half)
    same cost        N H800, N the most the mixed cluster's price buys (whole engines)

Each runs tag, async and streaming (colocated cannot use rollout-only GPUs), each at its best engine
concurrency: rollout.max_num_seqs in 256, 128, 64 and, for the mixed cluster's H20 engines on their
own, cluster.rollout_pool.max_num_seqs in 256, 128, 64, 32 (the best by throughput, which on one
cluster is also the cheapest per token; every run is in the JSON, and the table also gives the
throughput with 256 everywhere, the default). Also printed: one engine's decode speed on each device,
which says why the result comes out as it does, and the H20 price at which the mixed cluster would
cost as little per trained token as the better of the two H800 clusters.

    python -m experiments.heterogeneous [--steps N] [--price-ratio 0.7] [--jobs N] [--out DIR]

Prices are an assumption, relative: an H800 GPU-hour costs 1 and an H20 GPU-hour `--price-ratio`
(default 0.70), so costs read in H800 GPU-hours per million trained tokens. Basis of 0.70: Reuters
(January 2024) reported 8-GPU H20 servers offered in China at about 1.4 million yuan, and 8-GPU H800
servers sold at about 2 million yuan at their launch a year before; we assume an hour of a GPU
costs in proportion to its server. Running costs (power, hosting) are not in the ratio.

Writes, in `--out` (default experiments/out/heterogeneous): heterogeneous.json (every run's summary,
the best of each cluster and policy, the decode speeds, the break-even price ratios and the
assumptions), config.yaml (the mixed cluster's resolved config, default concurrency) and
heterogeneous.png (best throughput and cost per policy and cluster).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
from pathlib import Path

from core import specs
from core.cli import run_main
from experiments._common import NO_STAMP, run_policy, save_config, save_json, source_fingerprint
from sim.config import CONFIG_DIR, SimConfig, load_config
from sim.cost import CostModel

PRICE_RATIO = 0.70  # H20 / H800 per GPU-hour: an assumption (see the module docstring)
PRICE_BASIS = (
    "assumption: H20 / H800 price per GPU-hour = ratio of 8-GPU server prices reported by Reuters in "
    "January 2024 (H20 about 1.4 million yuan, H800 about 2 million yuan at its launch a year before); "
    "power and hosting not included"
)
POLICIES = ("tag", "async", "streaming")
TRAIN_GPUS = 32  # H800, train-capable, in every cluster
MIXED_ROLLOUT_GPUS = 32  # H20, rollout-only
# Tried first to last, the default first: of runs that tie (a knob a policy does not use) the first is kept.
DEFAULT_SEQS = 256  # rollout.max_num_seqs in default.yaml
SEQS = (256, 128, 64)  # rollout.max_num_seqs tried on every cluster
POOL_SEQS = (256, 128, 64, 32)  # cluster.rollout_pool.max_num_seqs tried on the mixed cluster
COLOURS = {"mixed": "#ff7f0e", "same GPU count": "#1f77b4", "same cost": "#9ecae1"}
DECODE_BATCHES = (1, 32, 256)
DECODE_CONTEXT = 3000  # tokens per running sequence: about a median prompt and response's midpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.heterogeneous", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    p.add_argument(
        "--price-ratio",
        type=float,
        default=PRICE_RATIO,
        help=f"H20 / H800 price per GPU-hour (default {PRICE_RATIO}; an assumption)",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--out", default="experiments/out/heterogeneous", help="output folder")
    args = p.parse_args(argv)
    if args.steps < 1 or args.price_ratio <= 0 or args.jobs < 1:
        p.error(
            f"--steps and --jobs must be >= 1 and --price-ratio > 0, got {args.steps}, {args.jobs}, {args.price_ratio}"
        )
    return args


def clusters(steps: int, ratio: float) -> dict[str, list[str]]:
    """Each cluster's config overrides (over hetero.yaml for the mixed one, the default for the others),
    priced in H800 GPU-hours: the same 32 trainers, different rollout pools."""
    common = [f"num_steps={steps}", "cluster.price_per_gpu_hour=1.0"]
    mixed = [*common, f"cluster.rollout_pool.price_per_gpu_hour={ratio}"]
    cfg = load_config(CONFIG_DIR / "hetero.yaml", mixed)
    assert cfg.cluster.num_gpus == TRAIN_GPUS and cfg.cluster.rollout_pool.num_gpus == MIXED_ROLLOUT_GPUS
    tp = cfg.rollout.tensor_parallel
    same_cost = int((cfg.price_per_hour - TRAIN_GPUS) // tp) * tp  # H800 rollout GPUs the rest of the price buys

    def uniform(rollout_gpus: int) -> list[str]:
        total = TRAIN_GPUS + rollout_gpus  # train_fraction = train / total gives back exactly TRAIN_GPUS
        return [*common, f"cluster.num_gpus={total}", f"pools.train_fraction={TRAIN_GPUS / total}"]

    return {"mixed": mixed, "same GPU count": uniform(MIXED_ROLLOUT_GPUS), "same cost": uniform(same_cost)}


def load(name: str, overrides: list[str]) -> SimConfig:
    return load_config(CONFIG_DIR / "hetero.yaml" if name == "mixed" else None, overrides)


def settings(name: str) -> list[tuple[int, int | None]]:
    """(rollout.max_num_seqs, cluster.rollout_pool.max_num_seqs) pairs tried on a cluster."""
    if name != "mixed":
        return [(s, None) for s in SEQS]
    return list(itertools.product(SEQS, POOL_SEQS))


def _job(job: tuple[SimConfig, str]) -> dict:
    return run_policy(*job)


def run_all(bases: dict[str, list[str]], jobs: int) -> list[dict]:
    """Every (cluster, concurrency, policy) run: its keys and summary, in a fixed order."""
    plan = []
    for name, overrides in bases.items():
        for seqs, pool_seqs in settings(name):
            extra = [f"rollout.max_num_seqs={seqs}"] + (
                [f"cluster.rollout_pool.max_num_seqs={pool_seqs}"] if pool_seqs is not None else []
            )
            cfg = load(name, [*overrides, *extra])
            plan += [
                ({"cluster": name, "max_num_seqs": seqs, "pool_max_num_seqs": pool_seqs, "policy": p}, cfg, p)
                for p in POLICIES
            ]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        summaries = pool.map(_job, [(cfg, p) for _, cfg, p in plan], chunksize=1)
    return [{**keys, "summary": s} for (keys, _, _), s in zip(plan, summaries, strict=True)]


def best_runs(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """cluster -> policy -> its fastest run (the first of equals), with the default's throughput beside it."""
    best: dict[str, dict[str, dict]] = {}
    default: dict[tuple[str, str], float] = {}  # (cluster, policy) -> throughput with every engine at 256
    for run in runs:
        throughput = run["summary"]["token_throughput"]
        if run["max_num_seqs"] == DEFAULT_SEQS and run["pool_max_num_seqs"] in (None, DEFAULT_SEQS):
            default[run["cluster"], run["policy"]] = throughput
        current = best.setdefault(run["cluster"], {}).get(run["policy"])
        if current is None or throughput > current["summary"]["token_throughput"]:
            best[run["cluster"]][run["policy"]] = run
    return {
        name: {p: {**run, "default_token_throughput": default[name, p]} for p, run in by_policy.items()}
        for name, by_policy in best.items()
    }


def cost_per_token(run: dict) -> float:
    return run["summary"]["cost_per_million_tokens"]


def break_even(best: dict[str, dict[str, dict]], policy: str, ratio: float) -> float:
    """The H20 / H800 price ratio at which the mixed cluster's cost per trained token equals the
    better H800 cluster's. Mixed costs (32 + 32 r) per hour; its cost per token is linear in r."""
    mixed = best["mixed"][policy]
    hours_per_mtok = cost_per_token(mixed) / (TRAIN_GPUS + MIXED_ROLLOUT_GPUS * ratio)  # per unit of price
    uniform = min(cost_per_token(best[name][policy]) for name in best if name != "mixed")
    return (uniform / hours_per_mtok - TRAIN_GPUS) / MIXED_ROLLOUT_GPUS


def decode_speeds(cfg: SimConfig) -> dict[str, dict[int, float]]:
    """Tokens per second of one engine (rollout.tensor_parallel GPUs) decoding `batch` sequences of
    DECODE_CONTEXT tokens, on each device of the mixed cluster (no trainer's weight shard beside it)."""
    model = specs.model(cfg.model)
    out = {}
    for name in (cfg.cluster.device, cfg.cluster.rollout_pool.device):
        cost = CostModel(cfg, model, specs.device(name))
        out[name] = {b: round(b * 100 / cost.decode_run_s(b, b * DECODE_CONTEXT, 100), 1) for b in DECODE_BATCHES}
    return out


def table(best: dict[str, dict[str, dict]], labels: dict[str, str]) -> str:
    head = (
        f"{'cluster':<16}{'GPUs':<18}{'policy':<11}{'seqs':>9}{'tok/s':>8}{'cost/Mtok':>11}{'bubble':>8}"
        f"{'lag':>6}{'at 256':>9}"
    )
    lines = [head]
    for name, by_policy in best.items():
        for policy, run in by_policy.items():
            s = run["summary"]
            seqs = f"{run['max_num_seqs']}" + (f"/{run['pool_max_num_seqs']}" if run["pool_max_num_seqs"] else "")
            lines.append(
                f"{name:<16}{labels[name]:<18}{policy:<11}{seqs:>9}{s['token_throughput']:>8,.0f}"
                f"{s['cost_per_million_tokens']:>11.3f}{s['bubble_fraction']:>8.1%}{s['staleness']['mean_lag']:>6.2f}"
                f"{run['default_token_throughput']:>9,.0f}"
            )
    lines.append(
        "seqs: the best rollout.max_num_seqs (/ the H20 engines' own); cost/Mtok: H800 GPU-hours per "
        "million trained tokens; at 256: tok/s with every engine at the default 256"
    )
    return "\n".join(lines)


def legend_label(name: str, cfg: SimConfig) -> str:
    """The cluster and its price in H800 GPU-hours per hour: "mixed: 32 H800 + 32 H20, price 54.4/h"."""
    return f"{name}: {cfg.cluster_label.replace(' x ', ' ').upper()}, price {cfg.price_per_hour:g}/h"


def footnote(mixed: SimConfig, speeds: dict[str, dict[int, float]], ratio: float) -> str:
    """Why the figure comes out as it does, and the assumptions it rests on."""
    batch, tp = DECODE_BATCHES[-1], mixed.rollout.tensor_parallel
    h800, h20 = (speeds[d][batch] for d in (mixed.cluster.device, mixed.cluster.rollout_pool.device))
    return (
        f"Why: one {tp}-GPU engine decodes a full batch ({batch} sequences) at {h20:,.0f} tokens/s on H20 against "
        f"{h800:,.0f} on H800: the H20 is compute-bound (148 against 989 bf16 TFLOPS).\n"
        "Only tag, whose H800 trainers also roll out, gains much from giving the H20 engines fewer requests each: "
        "more are left to the faster H800s.\n"
        f"Prices (an assumption): an H20 GPU-hour costs {ratio:.2f} of an H800's, the ratio of 8-GPU server prices "
        "reported by Reuters (Jan 2024); prices and costs in H800 GPU-hours.\n"
        f"Each bar: the best engine concurrency of its cluster and policy. Same cost: the most H800 the mixed "
        f"cluster's price buys, in whole {tp}-GPU engines."
    )


def draw(best: dict[str, dict[str, dict]], legend: dict[str, str], title: str, note: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, policies = list(best), list(POLICIES)
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.6))
    width = 0.8 / len(names)
    panels = (
        ("token_throughput", 1e-3, "trained tokens per second (thousands)", "throughput: higher is better", "{:.1f}k"),
        (
            "cost_per_million_tokens",
            1.0,
            "H800 GPU-hours per million trained tokens",
            "cost per trained token: lower is better",
            "{:.2f}",
        ),
    )
    for ax, (key, scale, ylabel, heading, fmt) in zip(axes, panels, strict=True):
        for i, name in enumerate(names):
            xs = [p + (i - (len(names) - 1) / 2) * width for p in range(len(policies))]
            values = [best[name][p]["summary"][key] * scale for p in policies]
            bars = ax.bar(xs, values, width, color=COLOURS[name], label=legend[name])
            ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=7.5, padding=2)
        ax.set_xticks(range(len(policies)), policies)
        ax.set_ylabel(ylabel)
        ax.set_title(heading, fontsize=9)
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.95),
        ncol=3,
        fontsize=8,
        frameon=False,
        title="32 H800 train in every cluster; the other GPUs only roll out",
        title_fontsize=8,
    )
    fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.1, 1, 0.9))
    fig.savefig(path, dpi=120, metadata=NO_STAMP)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: heterogeneous(args))


def heterogeneous(args: argparse.Namespace) -> int:
    source = source_fingerprint()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bases = clusters(args.steps, args.price_ratio)
    configs = {name: load(name, overrides) for name, overrides in bases.items()}
    labels = {name: cfg.cluster_label.replace(" x ", " ") for name, cfg in configs.items()}
    runs = run_all(bases, args.jobs)
    best = best_runs(runs)
    mixed = configs["mixed"]
    speeds = decode_speeds(mixed)
    even = {p: round(break_even(best, p, args.price_ratio), 4) for p in POLICIES}
    save_config(mixed, out / "config.yaml")
    save_json(
        {
            "source": source,
            "steps": args.steps,
            "price_ratio": args.price_ratio,
            "price_basis": PRICE_BASIS,
            "clusters": labels,
            "best": best,
            "runs": runs,
            "decode_tokens_per_s": speeds,
            "decode_context_tokens": DECODE_CONTEXT,
            "break_even_price_ratio": even,
        },
        out / "heterogeneous.json",
    )
    title = f"What should roll out beside 32 H800 trainers? {mixed.model}, {mixed.workload.kind}, {args.steps} steps"
    legend = {name: legend_label(name, cfg) for name, cfg in configs.items()}
    draw(best, legend, title, footnote(mixed, speeds, args.price_ratio), out / "heterogeneous.png")
    print(f"{title}\nprice ratio H20 / H800 per GPU-hour: {args.price_ratio:.2f} ({PRICE_BASIS})")
    print(table(best, labels))
    print(
        f"\none engine ({mixed.rollout.tensor_parallel} GPUs) decoding a batch of {DECODE_CONTEXT}-token sequences, "
        "tokens/s:"
    )
    for device, by_batch in speeds.items():
        print(f"  {device:<5}" + "".join(f"  batch {b:>3}: {v:>8,.0f}" for b, v in by_batch.items()))
    print(
        "H20 price (fraction of an H800's) below which mixed is the cheapest per trained token: "
        + ", ".join(f"{p} {r:.2f}" for p, r in even.items())
    )
    print(f"outputs: {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
