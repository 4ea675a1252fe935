"""benchmarks/swe_training.py's figures from a run folder written by hand: episodes per minute over the timeline's
wall time, the shares of the episodes' time, each pool's wall-time shares, and a resumed run counted alone."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from benchmarks.swe_training import main, report
from core.tags import Phase, SandboxPhase
from core.timeline import Interval, SandboxInterval, Timeline


def _step(step: int, reasons: dict, model: float, tools: float, tests: float, episode: float) -> dict:
    sums = {"model_s_sum": model, "tool_latency_s_sum": tools, "test_run_s_sum": tests, "episode_s_sum": episode,
            "sandbox_wait_s_sum": episode / 10}  # fmt: skip
    return {"kind": "step", "step": step, "episodes": {"exit_reasons": reasons, **sums}}


@pytest.fixture
def run(tmp_path):
    """A resumed run: step 0 before the kill, then steps 1 and 2 in 60 s of RL on a rollout-only resource R00 and a
    train resource T00, with two sandbox lanes."""
    records = [{"kind": "held_out", "label": "start", "step": 0}, _step(0, {"turn_limit": 4}, 99, 99, 99, 999),
               {"kind": "held_out", "label": "start", "step": 1},
               _step(1, {"submitted": 2, "turn_limit": 2}, 10.0, 2.0, 6.0, 20.0),
               _step(2, {"turn_limit": 4}, 5.0, 1.0, 3.0, 10.0),
               {"kind": "held_out", "label": "end", "step": 3}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    r, t = ("rollout",), ("rollout", "train")
    intervals = [Interval("R00", r, "rollout", Phase.ROLLOUT, 0.0, 20.0, 0, 100, 1),
                 Interval("R00", r, "rollout", Phase.IDLE, 20.0, 60.0, 1, 0, 1),
                 Interval("T00", t, "train", Phase.IDLE, 0.0, 30.0, 0, 0, 1),
                 Interval("T00", t, "train", Phase.TRAIN, 30.0, 54.0, 1, 50, 1),
                 Interval("T00", t, "train", Phase.SYNC, 54.0, 60.0, 2, 0, 1)]  # fmt: skip
    lanes = [SandboxInterval("sandbox-0", SandboxPhase.START, 0.0, 2.0, "s0"),
             SandboxInterval("sandbox-0", SandboxPhase.MODEL, 2.0, 12.0, "s0"),
             SandboxInterval("sandbox-0", SandboxPhase.TOOL, 12.0, 14.0, "s0"),
             SandboxInterval("sandbox-1", SandboxPhase.TEST_RUN, 14.0, 20.0, "s0")]  # fmt: skip
    Timeline(intervals, [], 60.0, sandboxes=lanes).save(tmp_path / "intervals.json")
    return tmp_path


def test_the_figures_of_a_resumed_run_count_its_own_steps(run):
    r = report(run)
    assert r["episodes"] == 8  # steps 1 and 2; step 0 belongs to the run before the kill
    assert r["episodes_per_minute"] == pytest.approx(8.0)
    assert r["exit_reasons"] == {"submitted": 2, "turn_limit": 6}
    assert r["shares"] == pytest.approx({"model_s": 0.5, "tool_latency_s": 0.1, "test_run_s": 0.3, "other": 0.1})
    assert r["sandbox_wait_share"] == pytest.approx(0.1)
    assert r["lanes"] == 2
    assert r["lane_shares"] == pytest.approx({"model": 0.5, "test_run": 0.3, "start": 0.1, "tool": 0.1})
    assert r["pools"]["rollout"] == pytest.approx({"idle": 2 / 3, "rollout": 1 / 3})
    assert r["pools"]["train"] == pytest.approx({"idle": 0.5, "train": 0.4, "sync": 0.1})


def test_main_prints_the_figures_of_a_finished_run(run):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["--run", str(run)])
    lines = printed.getvalue().splitlines()
    assert lines[0].startswith("SWE training: 8 training episodes in 60 s of RL = 8.0 episodes/min")
    assert "generating (waiting for the model) 50%, in sandboxes 40% (commands 10%, test runs 30%)" in lines[1]
    assert "blocked on a container's start 10%" in lines[1]
    assert lines[2] == "sandbox lanes (2, occupied time): model 50%, test_run 30%, start 10%, tool 10%"
    assert lines[3] == "wall time of the rollout-only resources: idle 67%, generating 33%"
    assert lines[4] == "wall time of the train resources: idle 50%, training 40%, syncing weights 10%"
