"""Tests for core.plot: a PNG comes out, sized by row count, for a small and a 512-row timeline."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from core.plot import DPI, draw_timeline, figure_height_in, plot_rows, row_ticks
from core.tags import Phase
from core.timeline import Interval, StepRecord, Timeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CYCLE = (Phase.ROLLOUT, Phase.SYNC, Phase.TRAIN, Phase.SWITCH, Phase.IDLE)


def make_timeline(rows: int, intervals_per_row: int, wall_s: float = 100.0) -> Timeline:
    """`rows` resources split over three pools, each row cycling through every phase."""
    pools = [("rollout",), ("train",), ("rollout", "train")]
    width = wall_s / intervals_per_row
    intervals = [
        Interval(f"gpu{r}", pools[r % 3], "rollout", CYCLE[(r + k) % 5], k * width, (k + 1) * width, k, 1, 1)
        for r in range(rows)
        for k in range(intervals_per_row)
    ]
    steps = [StepRecord(s, s * 10.0, (s + 1) * 10.0, 10, 5, {0: 5}) for s in range(int(wall_s // 10))]
    return Timeline(intervals, steps, wall_s, {"policy": "test"})


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_small_timeline_png(tmp_path):
    path = tmp_path / "small.png"
    draw_timeline(make_timeline(rows=4, intervals_per_row=10), path, title="small")
    width, height = png_size(path)
    assert width == 12 * DPI
    assert round(figure_height_in(4) * DPI) == 480 <= height < 480 + DPI  # grown where the key needs room


def test_512_rows_png_is_capped(tmp_path):
    path = tmp_path / "out" / "big.png"
    draw_timeline(make_timeline(rows=512, intervals_per_row=40), path)
    assert png_size(path) == (12 * DPI, 14 * DPI)
    assert path.stat().st_size > 10_000


def test_same_timeline_same_bytes(tmp_path):
    timeline = make_timeline(rows=6, intervals_per_row=5)
    draw_timeline(timeline, tmp_path / "a.png")
    draw_timeline(timeline, tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_empty_timeline_still_draws(tmp_path):
    path = tmp_path / "empty.png"
    draw_timeline(Timeline([], [], 0.0), path)
    assert png_size(path)[0] == 12 * DPI


def test_rows_grouped_by_pool_in_natural_order():
    rows = plot_rows(make_timeline(rows=12, intervals_per_row=2))
    assert rows[:4] == [("rollout", "gpu0"), ("rollout", "gpu3"), ("rollout", "gpu6"), ("rollout", "gpu9")]
    assert rows[4:8] == [("rollout+train", f"gpu{r}") for r in (2, 5, 8, 11)]
    assert [pool for pool, _ in rows[8:]] == ["train"] * 4


def test_row_ticks_per_resource_then_per_pool():
    small = plot_rows(make_timeline(rows=6, intervals_per_row=2))
    assert row_ticks(small) == [(float(y), res) for y, (_, res) in enumerate(small)]
    big = plot_rows(make_timeline(rows=512, intervals_per_row=2))
    assert row_ticks(big) == [(85.0, "rollout (171)"), (255.5, "rollout+train (170)"), (426.0, "train (171)")]


def test_figure_height_grows_then_caps():
    assert figure_height_in(0) == 3.0
    assert figure_height_in(8) == 5.0
    assert figure_height_in(44) == 14.0
    assert figure_height_in(512) == 14.0


def test_rollout_bars_pale_with_fewer_tokens_per_device_second():
    from matplotlib.colors import to_rgb

    from core.plot import PHASE_COLOURS, SPARSE_ROLLOUT, _rollout_shades

    shades = _rollout_shades([0.0, 50.0, 100.0, 100.0])
    assert shades[0] == pytest.approx(to_rgb(SPARSE_ROLLOUT))
    assert shades[2] == pytest.approx(to_rgb(PHASE_COLOURS[Phase.ROLLOUT]))
    mid = shades[1]
    assert all(min(a, b) <= m <= max(a, b) for a, b, m in zip(shades[0], shades[2], mid, strict=True))
    assert mid != shades[0] and mid != shades[2]
