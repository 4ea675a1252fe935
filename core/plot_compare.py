"""Several runs stacked top to bottom on one shared time axis (`python -m sim --compare`'s compare.png): one
panel a run, titled with its throughput (relative to the first run's) and bubble, with one legend and one
rollout scale for all, drawn as `core.plot` draws a single run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from core.metrics import summarize
from core.plot import (
    _caption,
    _draw_bars,
    _key,
    _min_width_s,
    _new_figure,
    _row_caption,
    _setup_panel,
    plot_rows,
    save_figure,
    throughput_text,
    time_label,
)
from core.timeline import Timeline


def panel_title(summary: dict, baseline: dict) -> str:
    """A run's headline numbers: throughput (and its ratio to `baseline`), bubble, steps and time."""
    ratio = summary["token_throughput"] / baseline["token_throughput"] if baseline["token_throughput"] else 0.0
    versus = " (the baseline)" if summary is baseline else f" = {ratio:.2f}x {baseline['policy']}"
    return (
        f"{summary['policy']}:  {throughput_text(summary)}{versus},  "
        f"bubble {summary['bubble_fraction']:.1%},  {summary['num_steps']} steps in {summary['wall_s']:,.0f} s"
    )


def compare_title(timeline: Timeline) -> str:
    meta = timeline.meta
    keys = ("model", "workload", "num_gpus", "device", "seed")
    if not all(k in meta for k in keys):
        return "the same workload under each policy"
    return f"{meta['model']}, {meta['workload']}, {meta['num_gpus']} x {meta['device']}, seed {meta['seed']}"


def compare_figure(timelines: Sequence[Timeline], title: str | None = None):
    """Runs stacked top to bottom on one shared time axis, one panel each, titled with throughput
    (relative to the first run) and bubble; one legend and one rollout scale (shared) for all."""
    if not timelines:
        raise ValueError("compare_figure needs at least one timeline")
    heights = [min(3.0, max(1.0, 0.12 * len(plot_rows(t)))) for t in timelines]
    fig, axes = _new_figure(sum(heights) + 0.45 * len(timelines) + 1.2, len(timelines), heights)
    xmax = max(t.wall_s for t in timelines) * 1.01 or 1.0
    summaries = [summarize(t) for t in timelines]
    rows_of = []
    for ax, timeline, summary in zip(axes, timelines, summaries, strict=True):
        rows_of.append(_setup_panel(ax, timeline, xmax, 0, None))
        ax.axvline(timeline.wall_s, color="black", linewidth=1.5)
        ax.set_title(panel_title(summary, summaries[0]), loc="left", fontsize=9)
    axes[-1].set_xlabel(time_label(timelines[0]) + "  (solid line: the run's last step ends)")
    _caption(axes[-1], _row_caption(timelines))
    fig.suptitle(title or compare_title(timelines[0]), fontsize=10)
    bar_ax = axes[min(1, len(axes) - 1)]
    reference = _key(fig, axes[0], bar_ax, timelines, ({}, ()), 0.9 if axes[1:] else 0.4)
    min_width = _min_width_s(fig, axes[0])
    for ax, timeline, row_of in zip(axes, timelines, rows_of, strict=True):
        _draw_bars(ax, timeline, row_of, reference, min_width)
    return fig


def draw_compare(timelines: Sequence[Timeline], path: str | Path, title: str | None = None):
    """Save `compare_figure(timelines, title)` to `path`; returns the Figure."""
    fig = compare_figure(timelines, title)
    save_figure(fig, path)
    return fig
