"""The simulator's SWE workload from this runtime's episodes: the log-normal fit against its formula written out,
lengths read off a trajectory store written here, and the shipped workload run by the simulator."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import yaml

from core import config as cfgio
from reference.manager.store import TrajectoryStore
from sim.config import CONFIG_DIR, DEFAULT_CONFIG, Dist, SimConfig
from swebench_env.sim_workload import episode_shapes, fit, fit_store, fit_stores
from swebench_env.suite_workload import SUITE_WORKLOAD, task_workload
from swebench_env.training import SweTask, SweTaskConfig


def test_fit_is_the_log_normal_maximum_likelihood():
    samples = [2.0, 8.0, 32.0]
    logs = [math.log(x) for x in samples]
    mu = sum(logs) / 3
    sigma = math.sqrt(sum((v - mu) ** 2 for v in logs) / 3)
    assert fit(samples) == {"median": 8.0, "sigma": round(sigma, 3), "min": 2, "max": 32}
    assert fit([0.5, 0.5], integer=False) == {"median": 0.5, "sigma": 0.0, "min": 0.5, "max": 0.5}
    with pytest.raises(ValueError, match="positive"):
        fit([3, 0])


def _turn(store, sid: str, rid: str, anchor: str | None, match: int, new_prompt: int, generated: int) -> None:
    store.append(sid, rid, anchor, match, [7] * new_prompt, [5] * generated, [-0.1] * generated, [0] * generated,
                 "stop", "x")  # fmt: skip


@pytest.fixture
def run_store(tmp_path):
    """A run's store: episode e0 of three requests (100-token prompt; tool outputs of 20 and 30 tokens), episode e1
    of two that rewrites its history, a session no group names, and the group record on both episodes."""
    path = tmp_path / "trajectories.sqlite"
    with TrajectoryStore(path) as s:
        _turn(s, "g0-e0", "a", None, 0, 100, 10)  # prompt 100, sequence 110
        _turn(s, "g0-e0", "b", "a", 110, 20, 40)  # prompt 130: 20 added
        _turn(s, "g0-e0", "c", "b", 170, 30, 5)  # prompt 200: 30 added
        _turn(s, "g0-e1", "d", None, 0, 120, 50)  # prompt 120, sequence 170
        _turn(s, "g0-e1", "e", "d", 100, 10, 8)  # prompt 110: history trimmed, no tool output read
        _turn(s, "eval-0", "f", None, 0, 999, 999)
        episodes = [{"session_id": "g0-e0", "request_ids": ["a", "b", "c"], "exit_reason": "finished"},
                    {"session_id": "g0-e1", "request_ids": ["d", "e"], "exit_reason": "turn_limit"}]  # fmt: skip
        for sid in ("g0-e0", "g0-e1"):
            s.annotate(sid, {"meta": {"group": "g0", "episodes": episodes}})
    return path


def test_lengths_are_read_off_the_episodes_the_group_records_name(run_store):
    with TrajectoryStore(run_store) as s:
        shapes = episode_shapes(s)
    assert [(e.prompt_tokens, e.response_tokens, e.tool_output_tokens, e.exit_reason) for e in shapes] == [
        (100, (10, 40, 5), (20, 30), "finished"),
        (120, (50, 8), (), "turn_limit"),
    ]
    fitted = fit_store(run_store)
    assert fitted["turns"] == fit([3, 2])
    assert fitted["response_tokens"] == fit([10, 40, 5, 50, 8])
    assert fitted["exit_reasons"] == {"finished": 1, "turn_limit": 1}


def test_several_stores_are_fitted_together(run_store, tmp_path):
    other = tmp_path / "other.sqlite"
    with TrajectoryStore(other) as s:
        _turn(s, "g1-e0", "x", None, 0, 300, 30)
    both = fit_stores([run_store, other])
    assert both["episodes"] == 3 and both["exit_reasons"] == {"finished": 2, "turn_limit": 1}
    assert both["prompt_tokens"] == fit([100, 120, 300])
    with pytest.raises(ValueError, match="no episode"):
        fit_stores([tmp_path / "empty.sqlite"])


def test_a_store_without_group_records_is_one_episode_a_session(tmp_path):
    with TrajectoryStore(tmp_path / "demonstrations.sqlite") as s:
        _turn(s, "demo-1", "a", None, 0, 50, 5)
        _turn(s, "demo-1", "b", "a", 55, 9, 6)
        assert [(e.prompt_tokens, e.tool_output_tokens) for e in episode_shapes(s)] == [(50, (9,))]


def test_the_task_workload_is_the_suite_fit_bounded_by_the_task():
    w = SweTask(sandbox="local", max_turns=5, max_tokens=64, context_tokens=2048).simulator_workload()
    assert w["kind"] == "swe"
    assert w["turns"]["max"] == w["turns"]["median"] == 5
    assert w["response_tokens"]["max"] == 64
    assert w["max_context_tokens"] == 2048
    assert w["tool_latency_s"] == SUITE_WORKLOAD["tool_latency_s"]
    assert task_workload(SweTaskConfig()) == {**SUITE_WORKLOAD, "max_context_tokens": 4096}


def test_the_workload_is_expressible_in_the_simulator():
    swe = cfgio.merge(cfgio.load_yaml(DEFAULT_CONFIG), cfgio.load_yaml(CONFIG_DIR / "swe.yaml"))
    sim = cfgio.from_dict(SimConfig, cfgio.merge(swe, {"workload": task_workload(SweTaskConfig())}))
    assert sim.workload.kind == "swe"
    assert sim.workload.turns == Dist(**SUITE_WORKLOAD["turns"])
    assert sim.workload.max_context_tokens == 4096


def test_the_simulator_runs_the_workload(tmp_path):
    swe = cfgio.load_yaml(CONFIG_DIR / "swe.yaml")
    config = tmp_path / "swe-measured.yaml"
    config.write_text(yaml.safe_dump(cfgio.merge(swe, {"workload": task_workload(SweTaskConfig())})))
    small = ["--set", "num_steps=2", "--set", "workload.prompts_per_step=8"]
    argv = [sys.executable, "-m", "sim", "--config", str(config), "--policy", "tag", *small,
            "--out", str(tmp_path / "out"), "--no-picture", "--quiet"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = yaml.safe_load((tmp_path / "out" / "summary.json").read_text())
    assert summary["num_steps"] == 2
