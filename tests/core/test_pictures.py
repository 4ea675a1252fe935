"""Tests for what the pictures show: `python -m sim --compare` writes compare.png (one panel per
policy, one shared time axis), the legend lists only the phases that occur, sync and switch get a
minimum drawn width, idle and a thin batch differ in greyscale, and the axes say what they measure."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from core.plot import (
    DPI,
    LEGEND_GAP_PX,
    MIN_BAR_PX,
    PHASE_COLOURS,
    PHASE_HATCH,
    SPARSE_ROLLOUT,
    WIDTH_IN,
    Overlay,
    legend_gap_px,
    luminance,
    phases_present,
    time_label,
    timeline_figure,
)
from core.plot_compare import compare_figure
from core.policies import POLICIES
from core.tags import Phase, SandboxPhase
from core.timeline import Interval, SandboxInterval, StepRecord, Timeline
from sim.cli import main

SIM_META = {"policy": "tag", "model": "qwen3-8b", "device": "h800", "num_gpus": 4, "workload": "math", "seed": 0}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def timeline_of(spans: dict[str, list[tuple[Phase, float, float, int]]], wall_s: float, steps: int = 0) -> Timeline:
    """One resource per key, its (phase, start_s, end_s, tokens) in order; `steps` one-second steps."""
    intervals = [
        Interval(res, ("rollout",), "rollout", phase, start, end, 0, tokens, 1)
        for res, parts in spans.items()
        for phase, start, end, tokens in parts
    ]
    records = [StepRecord(s, s, s + 1.0, 10, 5, {0: 5}) for s in range(steps)]
    return Timeline(intervals, records, wall_s, dict(SIM_META))


def legend_texts(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def bars(ax, phase: Phase):
    (collection,) = [c for c in ax.collections if c.get_label() == f"_bars_{phase.value}"]
    return collection


def drawn_widths_px(ax, phase: Phase) -> list[float]:
    """Width on screen of each rectangle drawn for `phase`."""
    widths = []
    for path in bars(ax, phase).get_paths():
        xs = ax.transData.transform(path.vertices)[:, 0]
        widths.append(xs.max() - xs.min())
    return widths


@pytest.fixture(scope="module")
def compare_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare") / "run"
    small = ["cluster.num_gpus=32", "workload.prompts_per_step=16", "model=qwen3-8b", "rollout.tensor_parallel=2"]
    argv = ["--compare", "--quiet", "--out", str(out), "--set", "num_steps=2"]
    assert main([*argv, *(arg for key in small for arg in ("--set", key))]) == 0
    return out


def test_compare_writes_compare_png(compare_dir):
    width, height = png_size(compare_dir / "compare.png")
    assert width == WIDTH_IN * DPI
    assert height > 4 * DPI  # four panels stacked


def test_compare_has_one_panel_per_policy_on_a_shared_time_axis(compare_dir):
    timelines = [Timeline.load(compare_dir / name / "intervals.json") for name in POLICIES]
    fig = compare_figure(timelines)
    panels = [ax for ax in fig.axes if ax.get_title(loc="left")]
    assert [ax.get_title(loc="left").split(":")[0] for ax in panels] == list(POLICIES)
    assert all(panels[0].get_shared_x_axes().joined(panels[0], ax) for ax in panels)
    assert {ax.get_xlim() for ax in panels} == {(0.0, max(t.wall_s for t in timelines) * 1.01)}
    assert panels[-1].get_xlabel().startswith("simulated time (s)")


def test_compare_panel_titles_give_throughput_and_bubble(compare_dir):
    fig = compare_figure([Timeline.load(compare_dir / name / "intervals.json") for name in POLICIES])
    titles = [ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")]
    assert all("trained-sequence tok/s" in t and "bubble" in t for t in titles)
    assert "x colocated" in titles[-1]


def test_legend_lists_only_phases_that_occur():
    timeline = timeline_of({"r0": [(Phase.ROLLOUT, 0.0, 5.0, 50), (Phase.IDLE, 5.0, 10.0, 0)]}, 10.0)
    assert phases_present([timeline]) == [Phase.ROLLOUT, Phase.IDLE]
    assert legend_texts(timeline_figure(timeline)) == ["rollout (shade: see bar)", "idle"]


def test_legend_adds_step_ends_and_overlays_only_when_present():
    timeline = timeline_of({"r0": [(Phase.TRAIN, 0.0, 2.0, 10), (Phase.SYNC, 2.0, 3.0, 0)]}, 3.0, steps=2)
    overlay = Overlay("thrown away", (("r0", 0.0, 1.0, 0.5),))
    texts = legend_texts(timeline_figure(timeline, overlays=[overlay], phase_labels={Phase.SYNC: "paused"}))
    assert texts == ["train", "paused", "thrown away", "a training step ends"]


def test_short_phases_get_the_minimum_width():
    wall = 10_000.0
    parts = [
        (Phase.ROLLOUT, 0.0, 5_000.0, 10),
        (Phase.SYNC, 5_000.0, 5_000.01, 0),
        (Phase.SWITCH, 5_000.01, 5_000.02, 0),
    ]
    timeline = timeline_of({"r0": [*parts, (Phase.TRAIN, 5_000.02, wall, 10)]}, wall)
    ax = timeline_figure(timeline).axes[0]
    for phase in (Phase.SYNC, Phase.SWITCH):
        assert drawn_widths_px(ax, phase) == [pytest.approx(MIN_BAR_PX)]
    scale = ax.transData.transform((1.0, 0.0))[0] - ax.transData.transform((0.0, 0.0))[0]
    assert drawn_widths_px(ax, Phase.ROLLOUT) == [pytest.approx(5_000.0 * scale)]  # long phases to scale


def test_overlay_covers_its_share_of_the_row_from_the_bottom():
    timeline = timeline_of({"r0": [(Phase.ROLLOUT, 0.0, 10.0, 100)]}, 10.0)
    ax = timeline_figure(timeline, overlays=[Overlay("wasted", (("r0", 2.0, 4.0, 0.25),))]).axes[0]
    (marks,) = [c for c in ax.collections if c.get_label() == "_overlay_wasted"]
    ys = marks.get_paths()[0].vertices[:, 1]
    assert (ys.min(), ys.max()) == pytest.approx((0.4 - 0.8 * 0.25, 0.4))  # row 0 spans -0.4..0.4


def test_idle_and_thin_batch_differ_in_luminance():
    assert luminance(SPARSE_ROLLOUT) - luminance(PHASE_COLOURS[Phase.IDLE]) > 0.25
    assert Phase.IDLE in PHASE_HATCH  # and in texture


def test_idle_and_thin_batch_differ_in_greyscale_pixels(tmp_path):
    """Render a thin-batch row and an idle row, convert to greyscale, compare the mean of each bar."""
    import numpy as np
    from PIL import Image

    from core.plot import draw_timeline

    rows = {
        "r0": [(Phase.ROLLOUT, 0.0, 10.0, 0)],
        "r1": [(Phase.IDLE, 0.0, 10.0, 0)],
        "r2": [(Phase.ROLLOUT, 0, 10, 99)],
    }
    fig = draw_timeline(timeline_of(rows, 10.0), tmp_path / "t.png")
    ax = fig.axes[0]
    grey = Image.open(tmp_path / "t.png").convert("L")
    height = grey.size[1]

    def mean_grey(row: int) -> float:
        """Mean grey (0..1) of the middle of a row's bar; the hatch averages in."""
        (x0, y0), (x1, y1) = ax.transData.transform([(3.0, row - 0.3), (7.0, row + 0.3)])
        top, bottom = sorted((round(height - y0), round(height - y1)))
        return float(np.asarray(grey)[top:bottom, round(x0) : round(x1)].mean()) / 255

    assert mean_grey(0) - mean_grey(1) > 0.2


def test_time_axis_says_simulated_only_for_the_simulator():
    assert time_label(Timeline([], [], 1.0, {"device": "h800"})) == "simulated time (s)"
    assert time_label(Timeline([], [], 1.0, {"device": "cpu"})) == "time since the run started (s)"
    assert time_label(Timeline([], [], 1.0, {"clock": "measured"})).startswith("wall-clock time")


def test_sandbox_lanes_get_a_panel_of_their_own_with_tool_calls_at_least_the_minimum_width():
    wall = 1_000.0
    timeline = timeline_of({"r0": [(Phase.ROLLOUT, 0.0, wall, 100)]}, wall, steps=1)
    timeline.sandboxes = [
        SandboxInterval("sandbox-1", SandboxPhase.START, 0.0, 2.0),
        SandboxInterval("sandbox-1", SandboxPhase.MODEL, 2.0, 500.0),
        SandboxInterval("sandbox-1", SandboxPhase.TOOL, 500.0, 500.01),
        SandboxInterval("sandbox-0", SandboxPhase.TEST_RUN, 600.0, 700.0),
    ]
    fig = timeline_figure(timeline)
    top, lanes = fig.axes[:2]
    assert [t.get_text() for t in lanes.get_yticklabels()] == ["sandbox-0", "sandbox-1"]
    assert [t.get_text() for t in lanes.get_legend().get_texts()] == [
        "start-up (container started, checkout copied in)",
        "held by an episode, its agent waiting for the model",
        "tool call: a command runs (tool_latency_s)",
        "test run of the grader (test_run_s)",
    ]
    (tool,) = [c for c in lanes.collections if c.get_label() == "_sandbox_tool"]
    xs = lanes.transData.transform(tool.get_paths()[0].vertices)[:, 0]
    assert xs.max() - xs.min() == pytest.approx(MIN_BAR_PX)
    assert lanes.get_xlim() == top.get_xlim()  # one time axis
    assert "sandbox" not in " ".join(t.get_text() for t in top.get_yticklabels())  # not among the resources
    plain = timeline_figure(timeline_of({"r0": [(Phase.ROLLOUT, 0.0, wall, 100)]}, wall, steps=1))
    assert fig.get_figheight() > plain.get_figheight()  # the lanes add room rather than squeezing the resources


def test_a_timeline_without_sandboxes_draws_one_panel():
    timeline = timeline_of({"r0": [(Phase.ROLLOUT, 0.0, 10.0, 100)]}, 10.0)
    fig = timeline_figure(timeline)
    assert not [c for ax in fig.axes for c in ax.collections if c.get_label().startswith("_sandbox_")]
    assert sum(ax.get_legend() is not None for ax in fig.axes) == 1


def colour_bar_caption(fig):
    """The text above the rollout colour bar."""
    from matplotlib.text import Text

    (caption,) = fig.findobj(lambda o: isinstance(o, Text) and o.get_text().startswith("rollout shade"))
    return caption


EVERY_PHASE = [
    (Phase.ROLLOUT, 0.0, 4.0, 40),
    (Phase.SYNC, 4.0, 5.0, 0),
    (Phase.TRAIN, 5.0, 8.0, 0),
    (Phase.SWITCH, 8.0, 9.0, 0),
    (Phase.IDLE, 9.0, 10.0, 0),
]


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_the_legend_and_the_colour_bar_never_overlap(rows):
    """A run of few rows (the runtime's two resources) leaves little height for the legend (seven entries here)
    above the colour bar: the figure grows until the bar's caption lies below the legend."""
    timeline = timeline_of({f"r{i}": EVERY_PHASE for i in range(rows)}, 10.0, steps=3)
    fig = timeline_figure(timeline, "a title", overlays=[Overlay("thrown away", (("r0", 0.0, 1.0, 0.5),))])
    fig.draw_without_rendering()
    assert legend_gap_px(fig.axes[0].get_legend(), colour_bar_caption(fig)) >= LEGEND_GAP_PX


def test_compare_keeps_the_legend_and_the_colour_bar_apart_too():
    timelines = [timeline_of({"r0": EVERY_PHASE}, 10.0, steps=3) for _ in range(2)]
    fig = compare_figure(timelines)
    fig.draw_without_rendering()
    assert legend_gap_px(fig.axes[0].get_legend(), colour_bar_caption(fig)) >= LEGEND_GAP_PX


def test_a_window_of_a_run_keeps_the_runs_times_on_its_axis():
    timeline = timeline_of({"r0": [(Phase.ROLLOUT, 144.0, 150.0, 60), (Phase.TRAIN, 150.0, 160.0, 0)]}, 160.0)
    ax = timeline_figure(timeline, start_s=144.0).axes[0]
    assert ax.get_xlim() == (144.0, 160.0)
    assert drawn_widths_px(ax, Phase.ROLLOUT) == [pytest.approx(ax.bbox.width * 6.0 / 16.0)]
