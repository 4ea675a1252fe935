"""The overload benchmark: its summary finds the knee and every level beyond it (as multiples of it); it refuses a
baseline that is not a checkout; end to end (slow), a manager beside a CPU-bound process and the same manager run
from another checkout both take every level, and the 429s the manager counts as refused on arrival are reported."""

from __future__ import annotations

import json
import subprocess
import sys
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
