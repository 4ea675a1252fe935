"""Headline: how much faster than the colocated baseline is each policy on the default config?

The question behind SeamlessFlow's claim (~2x token throughput, 62% less training time than a
verl-style colocated baseline). We do not tune anything towards it: this runs the five policies on
the shipped default (Qwen3-32B, math, 64 H800, 20 steps, seed 0) and reports what the model gives.

    python -m experiments.headline
    python -m experiments.headline --set workload.response_tokens.max=32768 --out /tmp/headline-32k

Writes, in `--out` (default experiments/out/headline): headline.json (every summary, and each
policy's ratios to colocated: token throughput, mean step time, and training-time reduction
1 - wall_policy / wall_colocated for the same number of steps), config.yaml (the resolved config),
headline.png (throughput per policy, annotated with the ratio to colocated) and
headline_timelines.png (the four runs' timelines stacked on one simulated-time axis, as
`python -m sim --compare` draws them: where each policy's GPUs wait, and which run ends first).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from core.cli import add_config_args, run_main
from core.metrics import summarize
from core.plot_compare import draw_compare
from core.policies import POLICIES
from experiments._common import (
    NO_STAMP,
    PAPER_RATIO,
    save_config,
    save_json,
    source_fingerprint,
    wasted_share,
)
from sim.config import load_config
from sim.runner import simulate

BASELINE = "colocated"
COLOURS = {"colocated": "#7f7f7f", "disaggregated": "#bcbd22", "async": "#ff7f0e", "tag": "#1f77b4"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.headline", description=__doc__.splitlines()[0])
    add_config_args(p, default_config="sim/configs/default.yaml", example="workload.response_tokens.max=32768")
    p.add_argument("--out", default="experiments/out/headline", help="output folder")
    return p.parse_args(argv)


def ratios_to_baseline(summaries: dict[str, dict]) -> dict[str, dict[str, float]]:
    base = summaries[BASELINE]
    return {
        name: {
            "token_throughput": round(s["token_throughput"] / base["token_throughput"], 4),
            "step_time": round(s["step_time_s"]["mean"] / base["step_time_s"]["mean"], 4),
            "training_time_reduction": round(1.0 - s["wall_s"] / base["wall_s"], 4),
        }
        for name, s in summaries.items()
    }


def table(summaries: dict[str, dict], ratios: dict[str, dict[str, float]]) -> str:
    head = (
        f"{'policy':<14}{'tok/s':>9}{'x coloc':>9}{'step s':>8}{'wall s':>9}{'time saved':>11}"
        f"{'bubble':>8}{'wasted':>8}{'resp len':>9}"
    )
    lines = [head]
    for name, s in summaries.items():
        r = ratios[name]
        lines.append(
            f"{name:<14}{s['token_throughput']:>9,.0f}{r['token_throughput']:>8.2f}x{s['step_time_s']['mean']:>8.1f}"
            f"{s['wall_s']:>9,.0f}{r['training_time_reduction']:>11.1%}{s['bubble_fraction']:>8.1%}"
            f"{wasted_share(s):>8.1%}{s['trained_response_tokens_mean']:>9,.0f}"
        )
    lines.append(
        "wasted: share of generated tokens thrown away by staleness restarts; resp len: mean trained response tokens"
    )
    return "\n".join(lines)


def draw(summaries: dict[str, dict], ratios: dict[str, dict[str, float]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summaries)
    values = [summaries[n]["token_throughput"] / 1e3 for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    bars = ax.bar(names, values, color=[COLOURS.get(n, "#333333") for n in names])
    for bar, name in zip(bars, names, strict=True):
        r = ratios[name]
        cut = r["training_time_reduction"]
        label = f"{r['token_throughput']:.2f}x\n{abs(cut):.0%} {'less' if cut >= 0 else 'more'} time"
        label = "1.00x" if name == BASELINE else label
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=9,
        )
    claim = PAPER_RATIO * summaries[BASELINE]["token_throughput"] / 1e3
    ax.axhline(claim, color="#d62728", linestyle="--", linewidth=1)
    ax.text(
        len(names) - 0.5,
        claim,
        f"paper's claim ({PAPER_RATIO:.0f}x colocated)",
        ha="right",
        va="bottom",
        color="#d62728",
        fontsize=9,
    )
    ax.set_ylim(0, max(max(values), claim) * 1.18)
    ax.set_ylabel("trained tokens per second (thousands)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.text(
        0.01,
        0.01,
        "time: training time for the same number of steps, against colocated's "
        "(the paper reports 62% less for its system)",
        fontsize=7,
        color="#555555",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120, metadata=NO_STAMP)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: headline(args))


def headline(args: argparse.Namespace) -> int:
    source = source_fingerprint()  # before running: the sources as imported
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timelines = {name: simulate(cfg, name) for name in POLICIES}
    summaries = {name: summarize(timeline) for name, timeline in timelines.items()}
    ratios = ratios_to_baseline(summaries)
    save_config(cfg, out / "config.yaml")
    save_json(
        {"baseline": BASELINE, "overrides": args.overrides, "source": source, "ratios": ratios, "summaries": summaries},
        out / "headline.json",
    )
    title = (
        f"{cfg.model}, {cfg.workload.kind}, {cfg.cluster.num_gpus} x {cfg.cluster.device}, "
        f"{cfg.num_steps} steps, seed {cfg.seed}"
    )
    draw(summaries, ratios, title, out / "headline.png")
    draw_compare(list(timelines.values()), out / "headline_timelines.png", title)
    print(title)
    print(table(summaries, ratios))
    print(f"outputs: {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
