"""Tests for core.metrics: exact numbers on a hand-made timeline, conservation, and a naive reference."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from core.metrics import (
    IDLE_WARNING_SHARE,
    check_conservation,
    device_seconds_by_phase,
    idle_warnings,
    percentile,
    pool_idle_shares,
    summarize,
)
from core.tags import Phase
from core.timeline import Interval, StepRecord, Timeline

R, T, S, W, I = Phase.ROLLOUT, Phase.TRAIN, Phase.SYNC, Phase.SWITCH, Phase.IDLE
POOLS = {"r0": ("rollout",), "t0": ("train",), "c0": ("rollout", "train")}
DEVICES = {"r0": 2, "t0": 4, "c0": 1}

# resource -> [(phase, start_s, end_s, step, tokens)]; each row tiles [0, 10].
LAYOUT = {
    "r0": [(R, 0, 3, 0, 100), (S, 3, 4, 1, 0), (R, 4, 8, 1, 80), (S, 8, 9.5, 2, 0), (I, 9.5, 10, 2, 0)],
    "t0": [(T, 0, 3, 0, 300), (S, 3, 3.5, 1, 0), (I, 3.5, 5, 1, 0), (W, 5, 6, 1, 0), (T, 6, 10, 1, 200)],
    "c0": [(R, 0, 5, 0, 40), (W, 5, 5.5, 1, 0), (T, 5.5, 10, 2, 100)],
}
STEPS = [
    StepRecord(0, 0.0, 3.0, 300, 200, {0: 100}),
    StepRecord(1, 3.0, 5.5, 200, 100, {0: 50, 1: 30}),
    StepRecord(2, 5.5, 10.0, 100, 50, {2: 20, 1: 10}),
]


def make_timeline(layout: dict = LAYOUT, steps: list[StepRecord] = STEPS, wall_s: float = 10.0) -> Timeline:
    intervals = [
        Interval(res, POOLS[res], "rollout", phase, float(a), float(b), step, tokens, DEVICES[res])
        for res, rows in layout.items()
        for phase, a, b, step, tokens in rows
    ]
    return Timeline(intervals, list(steps), wall_s, {"policy": "test"}, {"wasted_tokens": 12.3456789})


def with_row(resource: str, index: int, row: tuple) -> dict:
    layout = {res: list(rows) for res, rows in LAYOUT.items()}
    layout[resource][index] = row
    return layout


def test_device_seconds_by_phase_exact():
    got = device_seconds_by_phase(make_timeline())
    assert got == {R: 19.0, T: 32.5, S: 7.0, W: 4.5, I: 7.0}


def test_summary_exact_numbers():
    m = summarize(make_timeline())
    assert m["policy"] == "test"
    assert m["num_steps"] == 3
    assert m["wall_s"] == 10.0
    assert m["token_throughput"] == 60.0
    assert m["generated_token_throughput"] == 35.0
    assert m["device_seconds"] == {"busy": 63.0, "idle": 7.0, "total": 70.0}
    assert m["bubble_fraction"] == 0.1
    assert m["utilisation"] == {
        "rollout": round(19 / 70, 6),
        "train": round(32.5 / 70, 6),
        "sync": 0.1,
        "switch": round(4.5 / 70, 6),
        "idle": 0.1,
    }
    assert m["pool_utilisation"] == {"rollout": 0.95, "rollout+train": 1.0, "train": 0.85}
    assert m["counters"] == {"wasted_tokens": 12.345679}


def test_conservation_busy_plus_idle_is_devices_times_wall():
    m = summarize(make_timeline())
    ds = m["device_seconds"]
    assert ds["busy"] + ds["idle"] == ds["total"] == sum(DEVICES.values()) * 10.0
    assert sum(m["utilisation"].values()) == pytest.approx(1.0, abs=1e-5)


def test_step_time_against_naive():
    m = summarize(make_timeline())
    durations = [3.0, 2.5, 4.5]
    assert m["step_time_s"] == {
        "mean": round(sum(durations) / 3, 6),
        "p50": 3.0,
        "p99": round(float(np.percentile(durations, 99)), 6),
    }
    assert m["step_time_s"]["p99"] == 4.47


def test_percentile_matches_numpy_linear():
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 100):
        values = [rng.uniform(0, 10) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_staleness_histogram_and_mean():
    st = summarize(make_timeline())["staleness"]
    assert st["histogram"] == {"0": 150, "1": 40, "2": 20}
    assert list(st["histogram"]) == ["0", "1", "2"]
    assert st["max_lag"] == 2
    assert st["mean_lag"] == round((0 * 150 + 1 * 40 + 2 * 20) / 210, 6)


def test_staleness_histogram_sorted_numerically():
    steps = [StepRecord(0, 0.0, 10.0, 10, 10, {10: 1, 2: 3, 0: 0})]
    st = summarize(make_timeline(steps=steps))["staleness"]
    assert list(st["histogram"]) == ["0", "2", "10"]
    assert st["max_lag"] == 10
    assert st["mean_lag"] == round((2 * 3 + 10) / 4, 6)


def test_sync_groups_by_step_and_start():
    # r0 and t0 both sync step 1 from t=3 (one operation, 1.0 s); r0 alone syncs step 2 for 1.5 s.
    sync = summarize(make_timeline())["sync_time_s"]
    assert sync == {"mean": 1.25, "total": 2.5, "count": 2}


def test_sync_same_start_different_step_is_two_operations():
    layout = with_row("t0", 1, (S, 3, 3.5, 7, 0))
    sync = summarize(make_timeline(layout))["sync_time_s"]
    assert sync == {"mean": round(3.0 / 3, 6), "total": 3.0, "count": 3}


@pytest.mark.parametrize(
    ("resource", "index", "row", "words"),
    [
        ("r0", 2, (R, 4.1, 8, 1, 80), "gap"),
        ("r0", 2, (R, 3.9, 8, 1, 80), "overlap"),
        ("t0", 0, (T, 0.5, 3, 0, 300), "gap"),
        ("c0", 2, (T, 5.5, 9.9, 2, 100), "wall_s"),
        ("c0", 2, (T, 5.5, 10.2, 2, 100), "wall_s"),
    ],
)
def test_broken_tiling_raises_naming_resource(resource, index, row, words):
    timeline = make_timeline(with_row(resource, index, row))
    with pytest.raises(ValueError, match=rf"'{resource}'.*{words}"):
        summarize(timeline)


def test_tiling_tolerates_float_noise():
    check_conservation(make_timeline(with_row("r0", 2, (R, 4 + 5e-7, 8, 1, 80))))


def test_interval_order_does_not_matter():
    timeline = make_timeline()
    shuffled = make_timeline()
    random.Random(1).shuffle(shuffled.intervals)
    assert summarize(shuffled) == summarize(timeline)


def test_summary_is_deterministic_json():
    m = summarize(make_timeline())
    text = json.dumps(m, sort_keys=True)
    assert json.loads(text) == m
    assert all(isinstance(k, str) for k in m["staleness"]["histogram"])


def test_empty_timeline_is_all_zeros():
    m = summarize(Timeline([], [], 0.0))
    assert m["policy"] is None
    assert m["num_steps"] == 0
    assert m["token_throughput"] == 0.0
    assert m["step_time_s"] == {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    assert m["device_seconds"] == {"busy": 0.0, "idle": 0.0, "total": 0.0}
    assert m["staleness"] == {"histogram": {}, "max_lag": 0, "mean_lag": 0.0}
    assert m["sync_time_s"] == {"mean": 0.0, "total": 0.0, "count": 0}


# ---- the summary's warning about a pool that idles most of the run ----


def test_a_train_pool_idle_most_of_the_run_is_warned_about():
    summary = {"policy": "tag", "pool_utilisation": {"rollout": 0.8, "rollout+train": 0.3}}
    assert pool_idle_shares(summary) == {"rollout": pytest.approx(0.2), "rollout+train": pytest.approx(0.7)}
    assert idle_warnings(summary) == [
        "warning: under tag, the rollout + train pool was idle 70% of the time: a larger batch or fewer train GPUs?"
    ]


def test_an_idle_rollout_pool_and_a_single_pool_get_their_own_hints():
    rollout = {"policy": "disaggregated", "pool_utilisation": {"rollout": 0.25, "train": 0.9}}
    assert idle_warnings(rollout, unit="resources") == [
        "warning: under disaggregated, the rollout pool was idle 75% of the time: more train resources or a looser "
        "staleness bound?"
    ]
    single = {"policy": "colocated", "pool_utilisation": {"rollout+train": 0.4}}
    assert idle_warnings(single) == [
        "warning: under colocated, the rollout + train pool was idle 60% of the time: a larger batch, or a policy "
        "that overlaps rollout and training?"
    ]


def test_no_warning_at_or_below_the_threshold():
    assert IDLE_WARNING_SHARE == 0.5
    summary = {"policy": "tag", "pool_utilisation": {"rollout": 0.5, "rollout+train": 0.51}}
    assert idle_warnings(summary) == []
