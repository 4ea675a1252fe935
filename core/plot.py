"""Draw timelines as pipeline Gantt charts: one row per resource, bars coloured by phase.

`draw_timeline` draws one run, or a window of it (`start_s`: the axis keeps the run's own times), titled with
its headline numbers (`run_headline`); `core.plot_compare.draw_compare` stacks several runs (e.g. the five
policies of `python -m sim --compare`) on one shared time axis, so the faster run visibly ends first.

What a reader has to tell apart at a glance, and how it is drawn:
- idle is mid-grey and hatched, so it differs from every rollout shade in colour, in greyscale
  (luminance) and in texture: a thin batch (pale rollout) must not read as idle, or the other way;
- rollout is shaded by generated tokens per device-second, from pale (none) to full green at the
  90th percentile of the rollout intervals drawn; a colour bar gives the scale. A device decoding a
  few stragglers is busy but pale;
- sync and switch last seconds in runs of hours, so they are drawn at least `MIN_BAR_PX` wide
  (centred on the interval, over their neighbours); every other phase is drawn to scale;
- the legend lists only the phases that occur; the caption says what a row is; the legend (top of the right
  margin) and the colour bar (its bottom) never overlap: a figure of few rows grows until they fit;
- a run with sandbox lanes (an agent task's containers: `Timeline.sandboxes`) gets a second panel under
  the resources, one row per lane, on the same time axis: start-up, spare, the agent waiting for the
  model (pale), tool calls and test runs (strong colours; tool calls last a fraction of a second, so they
  are drawn at least `MIN_BAR_PX` wide, like sync and switch), with a legend of its own.

Rows are grouped by pool and ordered naturally within it ("gpu2" before "gpu10"). Bars are drawn
as one rectangle collection per phase rather than one `broken_barh` per (resource, phase): on 512
rows the latter makes ~2,500 collections and spends most of its time re-computing data limits.
matplotlib is imported inside the functions and driven through an explicit Agg canvas rather than
`pyplot`, so importing this module is cheap and drawing never switches the caller's backend or
touches pyplot's global figure list.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.metrics import natural_key, pool_idle_shares, resources_by_pool
from core.run_log import SEQUENCE_RATE
from core.tags import Phase, SandboxPhase
from core.timeline import Interval, Timeline

PHASE_COLOURS = {
    Phase.ROLLOUT: "#4caf50",
    Phase.TRAIN: "#1f77b4",
    Phase.SYNC: "#ff7f0e",
    Phase.SWITCH: "#9c27b0",
    Phase.IDLE: "#8c8c8c",  # luminance 0.55, against 0.90 for the palest rollout shade
}
PHASE_LABELS = {
    Phase.ROLLOUT: "rollout (shade: see bar)",
    Phase.TRAIN: "train",
    Phase.SYNC: "weight sync",
    Phase.SWITCH: "role switch",
    Phase.IDLE: "idle",
}
PHASE_HATCH = {Phase.IDLE: "///"}
SANDBOX_COLOURS = {
    SandboxPhase.START: "#f2b134",  # amber
    SandboxPhase.SPARE: "#ffffff",  # white, dotted: a container nobody uses yet
    SandboxPhase.MODEL: "#c9d9ea",  # pale blue-grey: held, but nothing runs in it
    SandboxPhase.TOOL: "#d62728",  # red
    SandboxPhase.TEST_RUN: "#6a3d9a",  # dark purple
}
SANDBOX_LABELS = {
    SandboxPhase.START: "start-up (container started, checkout copied in)",
    SandboxPhase.SPARE: "spare (started ahead, waiting for an episode)",
    SandboxPhase.MODEL: "held by an episode, its agent waiting for the model",
    SandboxPhase.TOOL: "tool call: a command runs (tool_latency_s)",
    SandboxPhase.TEST_RUN: "test run of the grader (test_run_s)",
}
SANDBOX_HATCH = {SandboxPhase.SPARE: "...."}
SHORT_SANDBOX_PHASES = (SandboxPhase.TOOL,)  # drawn at least MIN_BAR_PX wide, on top of the rest
HATCH_COLOUR = "#e0e0e0"
SPARSE_ROLLOUT = "#d7f0d8"  # rollout that generates few tokens per device-second (a thin batch)
DENSE_QUANTILE = 0.9  # rollout at or above this quantile of interval densities gets the full colour
SHORT_PHASES = (Phase.SYNC, Phase.SWITCH)  # drawn at least MIN_BAR_PX wide, on top of the rest
MIN_BAR_PX = 2.0
MAX_LABELLED_ROWS = 64  # above this, label pools instead of individual resources
LEGEND_GAP_PX = 8.0  # at least this between the legend and the colour bar's caption below it
MAX_GROWTH_IN = 6.0  # the most a figure grows to keep them apart
DPI = 120
WIDTH_IN = 12.0
# Metadata that would otherwise embed a version string or a timestamp in the file.
_NO_STAMP = {
    ".png": {"Software": None},
    ".pdf": {"Creator": None, "Producer": None, "CreationDate": None},
    ".svg": {"Creator": None, "Date": None},
}


@dataclass(frozen=True)
class Overlay:
    """Marks drawn over rows, e.g. the part of an engine's batch whose work is later thrown away.

    spans: (resource, start_s, end_s, share): a box over [start_s, end_s] covering `share` (0..1)
    of the row's height from its bottom edge."""

    label: str
    spans: tuple[tuple[str, float, float, float], ...]
    colour: str = "#d62728"
    hatch: str = "xxx"


def figure_height_in(rows: int) -> float:
    """Figure height grows with the row count, capped so huge clusters stay viewable."""
    return min(14.0, 3.0 + 0.25 * rows)


def plot_rows(timeline: Timeline) -> list[tuple[str, str]]:
    """(pool, resource) from top to bottom."""
    return [(pool, res) for pool, resources in resources_by_pool(timeline).items() for res in resources]


def phases_present(timelines: Sequence[Timeline]) -> list[Phase]:
    """The phases with at least one interval of positive length, in legend order."""
    seen = {iv.phase for t in timelines for iv in t.intervals if iv.end_s > iv.start_s}
    return [phase for phase in PHASE_COLOURS if phase in seen]


def rollout_density(iv: Interval) -> float:
    """Tokens generated per device-second during a rollout interval."""
    return iv.tokens / ((iv.end_s - iv.start_s) * iv.devices)


def dense_reference(density: Sequence[float]) -> float:
    """The density drawn in full colour: the DENSE_QUANTILE of `density` (1.0 if that is 0)."""
    ranked = sorted(density)
    if not ranked:
        return 1.0
    return ranked[min(len(ranked) - 1, int(DENSE_QUANTILE * len(ranked)))] or 1.0


def _rollout_densities(timelines: Sequence[Timeline]) -> list[float]:
    return [
        rollout_density(iv)
        for t in timelines
        for iv in t.intervals
        if iv.phase is Phase.ROLLOUT and iv.end_s > iv.start_s
    ]


def _rollout_shades(density: list[float], reference: float | None = None) -> list[tuple[float, float, float]]:
    """Blend from SPARSE_ROLLOUT (no tokens) to the rollout colour (`reference`, by default the
    DENSE_QUANTILE of `density`)."""
    from matplotlib.colors import to_rgb

    reference = dense_reference(density) if reference is None else reference
    full, pale = to_rgb(PHASE_COLOURS[Phase.ROLLOUT]), to_rgb(SPARSE_ROLLOUT)
    shades = []
    for d in density:
        w = min(1.0, d / reference)
        shades.append(tuple(p + (f - p) * w for f, p in zip(full, pale, strict=True)))
    return shades


def luminance(colour) -> float:
    """Greyscale value (0 black .. 1 white) with the ITU-R 601 weights that PIL's "L" mode uses."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    return 0.299 * r + 0.587 * g + 0.114 * b


def _box(start: float, end: float, y: int, min_width_s: float, top: float = 0.4, bottom: float = 0.4) -> list:
    """Rectangle corners; at least `min_width_s` wide, centred on the interval."""
    pad = max(0.0, (min_width_s - (end - start)) / 2)
    lo, hi = start - pad, end + pad
    return [(lo, y - top), (hi, y - top), (hi, y + bottom), (lo, y + bottom)]


def _draw_bars(ax, timeline: Timeline, row_of: dict[str, int], reference: float, min_width_s: float) -> None:
    """One PolyCollection of rectangles per phase, added without autoscaling or layout (limits and
    layout are set by the caller); the short phases last, so they lie on top."""
    from matplotlib.collections import PolyCollection

    boxes: dict[Phase, list] = {phase: [] for phase in Phase}
    density: list[float] = []
    for iv in sorted(timeline.intervals, key=lambda iv: (row_of[iv.resource], iv.start_s, iv.end_s)):
        if iv.end_s > iv.start_s:
            widen = min_width_s if iv.phase in SHORT_PHASES else 0.0
            boxes[iv.phase].append(_box(iv.start_s, iv.end_s, row_of[iv.resource], widen))
            if iv.phase is Phase.ROLLOUT:
                density.append(rollout_density(iv))
    order = [p for p in Phase if p not in SHORT_PHASES] + list(SHORT_PHASES)
    for phase in order:
        if not boxes[phase]:
            continue
        colours = _rollout_shades(density, reference) if phase is Phase.ROLLOUT else PHASE_COLOURS[phase]
        bars = PolyCollection(boxes[phase], facecolors=colours, linewidths=0, antialiaseds=False)
        if phase in PHASE_HATCH:
            bars.set_hatch(PHASE_HATCH[phase])
            bars.set_edgecolor(HATCH_COLOUR)  # the hatch takes the edge colour; edges are 0 wide
        bars.set_label(f"_bars_{phase.value}")  # found by tests; the leading _ keeps it out of legends
        bars.set_in_layout(False)
        ax.add_collection(bars, autolim=False)


def _draw_overlays(ax, overlays: Sequence[Overlay], row_of: dict[str, int]) -> None:
    from matplotlib.collections import PolyCollection

    for overlay in overlays:
        verts = [
            _box(start, end, row_of[res], 0.0, top=0.8 * share - 0.4)
            for res, start, end, share in overlay.spans
            if res in row_of and end > start and share > 0
        ]
        marks = PolyCollection(verts, facecolors=(0, 0, 0, 0), edgecolors=overlay.colour, linewidths=0)
        marks.set_hatch(overlay.hatch)
        marks.set_label(f"_overlay_{overlay.label}")
        marks.set_in_layout(False)
        ax.add_collection(marks, autolim=False)


def row_ticks(rows: list[tuple[str, str]], max_labelled: int = MAX_LABELLED_ROWS) -> list[tuple[float, str]]:
    """(y, label) ticks: one per resource for small clusters, one per pool (centred) for large ones."""
    if len(rows) <= max_labelled:
        return [(float(y), res) for y, (_, res) in enumerate(rows)]
    first: dict[str, int] = {}
    count: dict[str, int] = defaultdict(int)
    for y, (pool, _) in enumerate(rows):
        first.setdefault(pool, y)
        count[pool] += 1
    return [(first[p] + (count[p] - 1) / 2, f"{p} ({count[p]})") for p in first]


def pool_label(pool: str) -> str:
    """A pool is named by what its resources can run: "rollout+train" -> "rollout + train pool"."""
    return pool.replace("+", " + ") + " pool"


def throughput_text(summary: dict) -> str:
    """`token_throughput` in words: every token of the trained sequences (prompt and response) per second."""
    return f"{summary['token_throughput']:,.0f} {SEQUENCE_RATE}"


def idle_text(summary: dict) -> str:
    """The run's idle share, and each pool's where there are several: "idle 27%: rollout pool 49%, ..."."""
    shares = pool_idle_shares(summary)
    whole = f"idle {summary['bubble_fraction']:.0%}"
    if len(shares) < 2:
        return whole
    return whole + ": " + ", ".join(f"{pool_label(pool)} {share:.0%}" for pool, share in shares.items())


def run_headline(summary: dict) -> str:
    """A run's numbers for a picture's title: throughput, step time and idle shares."""
    step = summary["step_time_s"]["mean"]
    return f"{throughput_text(summary)}  ·  mean step {_number(step)} s  ·  {idle_text(summary)}"


def _label_rows(ax, rows: list[tuple[str, str]], max_labelled: int, ylabel: str | None) -> None:
    """Tick labels and a line between pools; per-resource ticks get their pool's name beside them (or
    `ylabel` for all rows), per-pool ticks read "rollout pool / 8 resources"."""
    ticks = row_ticks(rows, max_labelled)
    per_resource = len(ticks) == len(rows)
    labels = [label for _, label in ticks]
    if not per_resource:
        sizes = Counter(pool for pool, _ in rows)
        labels = [f"{pool_label(p)}\n{sizes[p]} resource{'s' * (sizes[p] > 1)}" for p in dict.fromkeys(sizes)]
    ax.set_yticks([y for y, _ in ticks], labels, fontsize=7 if per_resource else 8)
    ax.tick_params(axis="y", length=0)
    for y in range(1, len(rows)):
        if rows[y][0] != rows[y - 1][0]:
            ax.axhline(y - 0.5, color="black", linewidth=0.6)
    if ylabel is not None or not per_resource:
        ax.set_ylabel(ylabel or "")
        return
    width_pt = 7 * 0.65 * max((len(r) for _, r in rows), default=1) + 8
    row_pt = ax.figure.get_figheight() * 72 * 0.75 / max(len(rows), 1)  # about 3/4 of the figure is axes
    spans: dict[str, list[int]] = defaultdict(list)
    for y, (pool, _) in enumerate(rows):
        spans[pool].append(y)
    for pool, ys in spans.items():
        text = pool_label(pool)
        upright = len(ys) * row_pt > 8 * 0.6 * len(text)  # fits along its rows: rotate, else write it across
        ax.annotate(
            text,
            xy=(0, (ys[0] + ys[-1]) / 2),
            xycoords=("axes fraction", "data"),
            xytext=(-width_pt, 0),
            textcoords="offset points",
            rotation=90 if upright else 0,
            ha="right",
            va="center",
            fontsize=8,
        )


def time_label(timeline: Timeline) -> str:
    """The x-axis label: "simulated time (s)" for a simulated run, else the time base of a measured one.

    meta["clock"] ("simulated" or "measured") decides where an executor sets it; otherwise a device
    named in core/specs means the simulator wrote the record (the real runtime records "cpu")."""
    from core import specs

    clock = timeline.meta.get("clock")
    if clock is None:
        clock = "simulated" if timeline.meta.get("device") in specs.devices() else None
    return {"simulated": "simulated time (s)", "measured": "wall-clock time since the run started (s)"}.get(
        clock, "time since the run started (s)"
    )


def _device_word(timeline: Timeline) -> str:
    device = timeline.meta.get("device")
    return "GPU" if device and device != "cpu" else "device"


def _legend(ax, phases: list[Phase], steps: bool, labels: dict[Phase, str], overlays: Sequence[Overlay]):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def patch(phase: Phase) -> Patch:
        return Patch(
            facecolor=PHASE_COLOURS[phase],
            edgecolor=HATCH_COLOUR if phase in PHASE_HATCH else "none",
            hatch=PHASE_HATCH.get(phase),
            linewidth=0,
            label={**PHASE_LABELS, **labels}[phase],
        )

    handles = [patch(phase) for phase in phases]
    handles += [
        Patch(facecolor="none", edgecolor=o.colour, hatch=o.hatch, linewidth=0, label=o.label) for o in overlays
    ]
    if steps:
        handles.append(Line2D([], [], color="black", linestyle="dashed", linewidth=0.8, label="a training step ends"))
    return ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)


def _colour_bar(fig, ax, reference: float, unit: str, height: float):
    """A vertical colour bar for the rollout shades, in the right margin at the axes' bottom; returns its
    caption (the text above it)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LinearSegmentedColormap, Normalize

    cmap = LinearSegmentedColormap.from_list("rollout", [SPARSE_ROLLOUT, PHASE_COLOURS[Phase.ROLLOUT]])
    cax = ax.inset_axes((1.02, 0.0, 0.012, height))
    bar = fig.colorbar(ScalarMappable(Normalize(0.0, reference), cmap), cax=cax, extend="max")
    bar.set_ticks([0.0, reference / 2, reference], labels=["0", _number(reference / 2), f"{_number(reference)} (p90)"])
    bar.ax.tick_params(labelsize=7)
    return bar.ax.set_title(
        f"rollout shade:\ntokens generated\nper {unit}-second\n(pale: few tokens,\ne.g. a thin batch)",
        fontsize=7,
        loc="left",
    )


def _number(x: float) -> str:
    """Three significant digits at most, thousands separated: 1,589 / 39.5 / 0.125."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _row_caption(timelines: Sequence[Timeline]) -> str:
    devices = sorted({iv.devices for t in timelines for iv in t.intervals})
    kind = timelines[0].meta.get("device") if timelines else None
    if len(devices) != 1:
        size = ""
    elif kind:
        size = f" of {devices[0]} × {kind}"
    else:
        size = f" ({devices[0]} device{'s' * (devices[0] > 1)})"
    return (
        f"Each row is one resource{size}, grouped into pools by the phases it can run. "
        f"Sync and switch are drawn at least {MIN_BAR_PX:g} px wide; all else to scale."
    )


def _caption(ax, text: str) -> None:
    ax.annotate(
        text,
        xy=(0, 0),
        xycoords="axes fraction",
        xytext=(0, -34),
        textcoords="offset points",
        va="top",
        fontsize=7.5,
        color="#444444",
    )


def legend_gap_px(legend, caption) -> float:
    """Pixels from the top of the colour bar's `caption` up to the bottom of the `legend` (negative: overlap)."""
    return legend.get_window_extent().y0 - caption.get_window_extent().y1


def keep_apart(fig, legend, caption, tries: int = 6) -> None:
    """Grow `fig` until the colour bar's `caption` lies at least LEGEND_GAP_PX below the `legend`: a run of few
    rows leaves too little height for both in the right margin. How much the gap widens per pixel of height
    depends on the panels; it is guessed, then measured (the secant method)."""
    rate = 0.5  # gap pixels gained per pixel of figure height
    limit_in = fig.get_figheight() + MAX_GROWTH_IN
    fig.draw_without_rendering()
    gap = legend_gap_px(legend, caption)
    for _ in range(tries):
        if gap >= LEGEND_GAP_PX or fig.get_figheight() >= limit_in:
            return
        grow_px = (LEGEND_GAP_PX + 1.0 - gap) / rate
        fig.set_figheight(fig.get_figheight() + grow_px / fig.dpi)
        fig.draw_without_rendering()
        widened = legend_gap_px(legend, caption)
        rate, gap = max(0.1, (widened - gap) / grow_px), widened


def _key(fig, ax, bar_ax, timelines: Sequence[Timeline], legend_options: tuple, bar_share: float) -> float:
    """The legend (top of `ax`'s right margin) and, when rollout is drawn, the colour bar of its shades (bottom
    of `bar_ax`'s), kept apart; returns the density drawn in full colour. `legend_options`: (phase labels,
    overlays)."""
    phases = phases_present(timelines)
    legend = _legend(ax, phases, any(t.steps for t in timelines), *legend_options)
    reference = dense_reference(_rollout_densities(timelines))
    if Phase.ROLLOUT in phases:
        caption = _colour_bar(fig, bar_ax, reference, _device_word(timelines[0]), bar_share)
        keep_apart(fig, legend, caption)
    return reference


def _min_width_s(fig, ax) -> float:
    """Seconds that MIN_BAR_PX pixels span once the layout is done."""
    fig.draw_without_rendering()
    lo, hi = ax.get_xlim()
    return MIN_BAR_PX * (hi - lo) / max(ax.bbox.width, 1.0)


def _new_figure(height_in: float, panels: int = 1, height_ratios: Sequence[float] | None = None):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False, height_ratios=height_ratios)[:, 0]
    return fig, list(axes)


def _setup_panel(
    ax, timeline: Timeline, xmax: float, max_labelled: int, ylabel: str | None, xmin: float = 0.0
) -> dict[str, int]:
    """Limits, step lines and row labels of one timeline's axes; its row of each resource."""
    rows = plot_rows(timeline)
    n = max(len(rows), 1)
    ax.set_xlim(xmin, xmax)
    ax.set_ylim(n - 0.5, -0.5)  # first row on top
    if timeline.steps:
        ends = [step.end_s for step in timeline.steps]
        ax.vlines(ends, -0.5, n - 0.5, colors="black", linestyles="dashed", linewidth=0.5, alpha=0.5)
    _label_rows(ax, rows, max_labelled, ylabel)
    return {res: y for y, (_, res) in enumerate(rows)}


def timeline_figure(
    timeline: Timeline,
    title: str | None = None,
    *,
    ylabel: str | None = None,
    phase_labels: dict[Phase, str] | None = None,
    overlays: Sequence[Overlay] = (),
    caption: str | None = None,
    start_s: float = 0.0,
):
    """The Gantt chart of `timeline` as a matplotlib Figure (on an Agg canvas); its sandbox lanes, where it has
    some, in a second panel below.

    ylabel: one label for every row, instead of pool names; phase_labels: legend text by phase;
    overlays: marks drawn over the bars; caption: the line under the axes (by default, what a row is);
    start_s: where the time axis starts, for a window of a run that keeps the run's times (its intervals start
    there and its wall_s is the window's end)."""
    rows = len(plot_rows(timeline))
    height = figure_height_in(rows)
    lanes = sandbox_lanes(timeline)
    if lanes:  # the resources' panel keeps room for its legend and colour bar
        top, lane_height = max(height - 1.3, 2.8), min(6.0, 0.8 + 0.22 * len(lanes))
        fig, (ax, lane_ax) = _new_figure(top + lane_height + 1.6, 2, [top, lane_height])
        height = top + 1.3
    else:
        fig, (ax,) = _new_figure(height)
    end_s = timeline.wall_s if timeline.wall_s > start_s else start_s + 1.0
    row_of = _setup_panel(ax, timeline, end_s, MAX_LABELLED_ROWS, ylabel, start_s)
    bottom = lane_ax if lanes else ax
    lane_of = _setup_lanes(lane_ax, timeline, lanes) if lanes else {}
    bottom.set_xlabel(time_label(timeline))
    _caption(bottom, _timeline_caption(timeline, caption, bool(lanes)))
    if title:
        ax.set_title(title)
    bar_share = min(0.4, 1.4 / max(height - 1.3, 1.0))
    reference = _key(fig, ax, ax, [timeline], (phase_labels or {}, overlays), bar_share)
    min_width = _min_width_s(fig, ax)
    _draw_bars(ax, timeline, row_of, reference, min_width)
    _draw_overlays(ax, overlays, row_of)
    if lanes:
        _draw_lanes(lane_ax, timeline, lane_of, min_width)
    return fig


def _timeline_caption(timeline: Timeline, caption: str | None, lanes: bool) -> str:
    text = _row_caption([timeline]) if caption is None else caption
    if lanes:
        text += "\nBelow: each row is one lane of the agent task's sandboxes (one container at a time); tool calls are "
        text += f"drawn at least {MIN_BAR_PX:g} px wide. Held-out evaluations' sandboxes are not drawn."
    return text


def sandbox_lanes(timeline: Timeline) -> list[str]:
    """The timeline's sandbox lanes from top to bottom, in natural order ("sandbox-2" before "sandbox-10")."""
    return sorted({sb.lane for sb in timeline.sandboxes}, key=natural_key)


def _setup_lanes(ax, timeline: Timeline, lanes: list[str]) -> dict[str, int]:
    """Limits, step lines, lane labels and legend of the sandbox panel; its row of each lane."""
    n = len(lanes)
    ax.set_ylim(n - 0.5, -0.5)
    if timeline.steps:
        ends = [step.end_s for step in timeline.steps]
        ax.vlines(ends, -0.5, n - 0.5, colors="black", linestyles="dashed", linewidth=0.5, alpha=0.5)
    labelled = n <= MAX_LABELLED_ROWS
    ax.set_yticks(range(n) if labelled else [], lanes if labelled else [], fontsize=7)
    ax.tick_params(axis="y", length=0)
    ax.set_ylabel(f"sandboxes\n({n} lanes)", fontsize=8)
    from matplotlib.patches import Patch

    present = {sb.phase for sb in timeline.sandboxes if sb.end_s > sb.start_s}
    handles = [
        Patch(
            facecolor=SANDBOX_COLOURS[k],
            edgecolor="#7f7f7f" if k in SANDBOX_HATCH else "none",
            hatch=SANDBOX_HATCH.get(k),
            linewidth=0.5 if k in SANDBOX_HATCH else 0,
            label=SANDBOX_LABELS[k],
        )
        for k in SandboxPhase
        if k in present
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    return {lane: y for y, lane in enumerate(lanes)}


def _draw_lanes(ax, timeline: Timeline, lane_of: dict[str, int], min_width_s: float) -> None:
    """One PolyCollection per sandbox phase; tool calls last, at least `min_width_s` wide."""
    from matplotlib.collections import PolyCollection

    boxes: dict[SandboxPhase, list] = {k: [] for k in SandboxPhase}
    for sb in timeline.sandboxes:
        if sb.end_s > sb.start_s:
            widen = min_width_s if sb.phase in SHORT_SANDBOX_PHASES else 0.0
            boxes[sb.phase].append(_box(sb.start_s, sb.end_s, lane_of[sb.lane], widen))
    order = [k for k in SandboxPhase if k not in SHORT_SANDBOX_PHASES] + list(SHORT_SANDBOX_PHASES)
    for kind in order:
        if not boxes[kind]:
            continue
        hatched = kind in SANDBOX_HATCH
        bars = PolyCollection(
            boxes[kind],
            facecolors=SANDBOX_COLOURS[kind],
            linewidths=0.5 if hatched else 0,
            edgecolors="#7f7f7f" if hatched else "none",
            antialiaseds=False,
        )
        if hatched:
            bars.set_hatch(SANDBOX_HATCH[kind])
        bars.set_label(f"_sandbox_{kind.value}")  # found by tests; the leading _ keeps it out of legends
        bars.set_in_layout(False)
        ax.add_collection(bars, autolim=False)


def draw_timeline(timeline: Timeline, path: str | Path, title: str | None = None, **options):
    """Save the Gantt chart of `timeline` to `path` (format from its suffix, e.g. .png); returns the
    Figure. `options` go to `timeline_figure`."""
    fig = timeline_figure(timeline, title, **options)
    save_figure(fig, path)
    return fig


def save_figure(fig, path: str | Path) -> None:
    """Write `fig` without version or time stamps, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata=_NO_STAMP.get(path.suffix.lower()))
