"""Draw a timeline as a pipeline Gantt chart: one row per resource, bars coloured by phase.

Rows are grouped by pool and ordered naturally within it ("gpu2" before "gpu10"). Bars are drawn
as one rectangle collection per phase rather than one `broken_barh` per (resource, phase): on 512
rows the latter makes ~2,500 collections and spends most of its time re-computing data limits.
matplotlib is imported inside the function and driven through an explicit Agg canvas rather than
`pyplot`, so importing this module is cheap and drawing never switches the caller's backend or
touches pyplot's global figure list.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from core.metrics import resources_by_pool
from core.tags import Phase
from core.timeline import Timeline

PHASE_COLOURS = {
    Phase.ROLLOUT: "#4caf50",
    Phase.TRAIN: "#1f77b4",
    Phase.SYNC: "#ff7f0e",
    Phase.SWITCH: "#9c27b0",
    Phase.IDLE: "#e6e6e6",
}
SPARSE_ROLLOUT = "#d7f0d8"  # rollout that generates few tokens per device-second (a thin batch)
MAX_LABELLED_ROWS = 64  # above this, label pools instead of individual resources
DPI = 120
# Metadata that would otherwise embed a version string or a timestamp in the file.
_NO_STAMP = {
    ".png": {"Software": None},
    ".pdf": {"Creator": None, "Producer": None, "CreationDate": None},
    ".svg": {"Creator": None, "Date": None},
}


def figure_height_in(rows: int) -> float:
    """Figure height grows with the row count, capped so huge clusters stay viewable."""
    return min(14.0, 3.0 + 0.25 * rows)


def plot_rows(timeline: Timeline) -> list[tuple[str, str]]:
    """(pool, resource) from top to bottom."""
    return [(pool, res) for pool, resources in resources_by_pool(timeline).items() for res in resources]


def _draw_bars(ax, timeline: Timeline, row_of: dict[str, int]) -> None:
    """One PolyCollection of rectangles per phase, added without autoscaling (limits are set by the caller).

    Rollout bars are shaded by tokens generated per device-second, relative to the run's dense
    rollout (90th percentile): a device decoding a few stragglers is busy but pale."""
    from matplotlib.collections import PolyCollection

    boxes: dict[Phase, list[list[tuple[float, float]]]] = {phase: [] for phase in Phase}
    density: list[float] = []
    for iv in sorted(timeline.intervals, key=lambda iv: (row_of[iv.resource], iv.start_s, iv.end_s)):
        if iv.end_s > iv.start_s:
            lo, hi = row_of[iv.resource] - 0.4, row_of[iv.resource] + 0.4
            boxes[iv.phase].append([(iv.start_s, lo), (iv.end_s, lo), (iv.end_s, hi), (iv.start_s, hi)])
            if iv.phase is Phase.ROLLOUT:
                density.append(iv.tokens / ((iv.end_s - iv.start_s) * iv.devices))
    for phase, verts in boxes.items():
        if not verts:
            continue
        colours = _rollout_shades(density) if phase is Phase.ROLLOUT else PHASE_COLOURS[phase]
        bars = PolyCollection(verts, facecolors=colours, linewidths=0, antialiaseds=False)
        ax.add_collection(bars, autolim=False)


def _rollout_shades(density: list[float]) -> list[tuple[float, float, float]]:
    """Blend from SPARSE_ROLLOUT (no tokens) to the rollout colour (90th-percentile density)."""
    from matplotlib.colors import to_rgb

    ranked = sorted(density)
    reference = ranked[min(len(ranked) - 1, int(0.9 * len(ranked)))] or 1.0
    full, pale = to_rgb(PHASE_COLOURS[Phase.ROLLOUT]), to_rgb(SPARSE_ROLLOUT)
    shades = []
    for d in density:
        w = min(1.0, d / reference)
        shades.append(tuple(p + (f - p) * w for f, p in zip(full, pale, strict=True)))
    return shades


def row_ticks(rows: list[tuple[str, str]]) -> list[tuple[float, str]]:
    """(y, label) ticks: one per resource for small clusters, one per pool (centred) for large ones."""
    if len(rows) <= MAX_LABELLED_ROWS:
        return [(float(y), res) for y, (_, res) in enumerate(rows)]
    first: dict[str, int] = {}
    count: dict[str, int] = defaultdict(int)
    for y, (pool, _) in enumerate(rows):
        first.setdefault(pool, y)
        count[pool] += 1
    return [(first[p] + (count[p] - 1) / 2, f"{p} ({count[p]})") for p in first]


def _label_rows(ax, rows: list[tuple[str, str]]) -> None:
    """Tick labels, plus a separator line between pools when resources are not labelled one by one."""
    ticks = row_ticks(rows)
    ax.set_yticks([y for y, _ in ticks], [label for _, label in ticks], fontsize=7 if len(ticks) == len(rows) else 8)
    if len(rows) > MAX_LABELLED_ROWS:
        for y in range(1, len(rows)):
            if rows[y][0] != rows[y - 1][0]:
                ax.axhline(y - 0.5, color="black", linewidth=0.6)


def _legend(ax) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=colour, label=phase.value) for phase, colour in PHASE_COLOURS.items()]
    handles.insert(1, Patch(facecolor=SPARSE_ROLLOUT, label="rollout, thin batch"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False, fontsize=8)


def draw_timeline(timeline: Timeline, path: str | Path, title: str | None = None) -> None:
    """Save the Gantt chart of `timeline` to `path` (format from its suffix, e.g. .png)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = plot_rows(timeline)
    n = max(len(rows), 1)
    row_of = {res: y for y, (_, res) in enumerate(rows)}
    fig = Figure(figsize=(12.0, figure_height_in(len(rows))), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlim(0.0, timeline.wall_s if timeline.wall_s > 0 else 1.0)
    ax.set_ylim(n - 0.5, -0.5)  # first row on top
    _draw_bars(ax, timeline, row_of)
    if timeline.steps:
        ends = [step.end_s for step in timeline.steps]
        ax.vlines(ends, -0.5, n - 0.5, colors="black", linestyles="dashed", linewidth=0.5, alpha=0.5)
    _label_rows(ax, rows)
    ax.set_xlabel("time (s)")
    _legend(ax)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata=_NO_STAMP.get(path.suffix.lower()))
