"""The overload benchmark: its summary finds the knee and every level beyond it (as multiples of it); it refuses a
baseline that is not a checkout; end to end (slow), a manager beside a CPU-bound process and the same manager run
from another checkout both take every level, and the 429s the manager counts as refused on arrival are reported;
SIGTERM stops it with every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.overload import summary

ROOT = Path(__file__).resolve().parents[2]


def _level(offered: int, goodput: float, cpu: float) -> dict:
    return {"offered_rps": offered, "goodput_rps": goodput, "cpu_share": {"proxy": cpu}}


def test_summary_gives_the_knee_and_every_level_beyond_it_as_multiples_and_shares_of_it():
    levels = [_level(100, 100, 0.2), _level(200, 150, 0.3), _level(300, 140, 0.3), _level(600, 120, 0.2)]
    s = summary(levels)
    assert (s["knee_offered_rps"], s["knee_goodput_rps"]) == (200, 150)
    assert [(a["offered_rps"], a["times_knee"]) for a in s["beyond"]] == [(300, 2.0), (600, 4.0)]
    four = s["beyond"][1]
    assert four["of_knee"] == pytest.approx(0.8)
    assert four["per_core_of_knee"] == pytest.approx((120 / 0.2) / (150 / 0.3))


def test_summary_of_a_server_that_answered_nothing():
    assert summary([_level(100, 0.0, 0.1)])["beyond"] == []


def _overload(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.overload", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_a_baseline_that_is_not_a_checkout_is_refused(tmp_path):
    done = _overload("--baseline", str(tmp_path))
    assert done.returncode == 2 and "is not a checkout of this project" in done.stderr


@pytest.mark.slow
def test_a_small_run_beside_a_cpu_bound_process_and_a_baseline(tmp_path):
    out = tmp_path / "o.json"
    args = ["--caps", "1", "--rates", "20,200", "--level-s", "1", "--share-core", "1", "--baseline", str(ROOT)]
    done = _overload(*args, "--json", str(out), timeout_s=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(with 1 CPU-bound processes)" in done.stdout
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"cap 1", "cap 1 base"}
    for run in runs.values():
        assert [f["offered_rps"] for f in run["levels"]] == [20, 200]
        assert all(sum(f["statuses"].values()) > 0 for f in run["levels"])
    # at a cap of one in flight, 200 requests a second get 429s, and this manager refuses them as they arrive
    assert any(f["on_arrival"] for f in runs["cap 1"]["levels"]), runs["cap 1"]["levels"]


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc's parent links)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


@pytest.mark.slow
def test_sigterm_stops_the_benchmark_and_every_server_it_started():
    args = ["--caps", "1,default", "--rates", "20,20,20,20", "--level-s", "5", "--share-core", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.overload", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        # the servers are up once the table's header is printed: engine, two managers and the CPU-bound process
        header = proc.stdout.readline()
        assert header.startswith("cores:"), header + proc.stderr.read()
        children = _descendants(proc.pid)
        assert len(children) >= 4, children
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == "stopped (SIGTERM)", err[-2000:]
    deadline = time.monotonic() + 30
    while (left := {pid for pid in children if _alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running after the benchmark ended: {left}"


def test_a_rate_offered_several_times_counts_by_its_median_level():
    levels = [
        _level(200, 300, 1.0),
        _level(800, 250, 1.0),
        _level(200, 240, 1.0),
        _level(800, 200, 1.0),
        _level(200, 270, 1.0),
        _level(800, 290, 1.0),
    ]
    s = summary(levels)
    # the single best level (300) is not the knee: the median of its rate's three levels is
    assert (s["knee_offered_rps"], s["knee_goodput_rps"], s["knee_range_rps"], s["knee_levels"]) == (
        200,
        270,
        [240, 300],
        3,
    )
    (beyond,) = s["beyond"]
    assert beyond["goodput_rps"] == 250 and beyond["range_rps"] == [200, 290]
    assert beyond["of_knee"] == pytest.approx(250 / 270)
    # paired by round: 250/300, 200/240, 290/270
    assert beyond["of_knee_paired"] == pytest.approx(200 / 240)
    assert beyond["paired_range"] == pytest.approx([250 / 300, 290 / 270])


def test_paired_by_round_compares_levels_of_one_stretch_where_the_medians_mix_fast_and_slow_rounds():
    """The machine is fast in rounds 0, 2 and 4 and slow in 1 and 3 (300 against 200 at the knee's rate); each round
    at 4x keeps 90-95% of its own knee but round 2's (65%). The medians compare round 2's slow 4x with a fast
    knee (200 of 300: 67%); paired by round, the rounds' ratios say 90%, with round 2's in the range."""
    knee, four = [300, 200, 310, 210, 305], [279, 180, 201, 189, 290]
    levels = []
    for r, (k, f) in enumerate(zip(knee, four, strict=True)):
        levels += [_level(400, k, 1.0) | {"round": r}, _level(1200, f, 1.0) | {"round": r}]
    (beyond,) = summary(levels)["beyond"]
    assert beyond["of_knee"] == pytest.approx(201 / 300)
    assert beyond["of_knee_paired"] == pytest.approx(0.9)
    assert beyond["paired_range"] == pytest.approx([201 / 310, 290 / 305])


def test_a_rate_offered_once_has_no_paired_figure():
    (beyond,) = summary([_level(400, 300, 1.0), _level(1200, 270, 1.0)])["beyond"]
    assert beyond["of_knee_paired"] is None and beyond["paired_range"] is None


def test_a_knee_at_the_highest_rate_offered_says_so_and_shows_the_rates_below_it():
    """At four times its goodput the manager still answers its best: the knee is the highest rate offered, at
    `knee_times` its own goodput, and the lower rate is shown as a share of it (`below`)."""
    levels = []
    for r, (low, high) in enumerate([(250, 280), (240, 290), (260, 250)]):
        levels += [_level(400, low, 1.0) | {"round": r}, _level(1200, high, 1.0) | {"round": r}]
    s = summary(levels)
    assert (s["knee_offered_rps"], s["knee_goodput_rps"], s["beyond"]) == (1200, 280, [])
    assert s["knee_times"] == pytest.approx(1200 / 280)
    (below,) = s["below"]
    assert below["offered_rps"] == 400 and below["of_knee"] == pytest.approx(250 / 280)
    assert below["of_knee_paired"] == pytest.approx(250 / 280)  # 250/280, 240/290, 260/250
