"""Tests for `python -m sim`: user mistakes end in one `error:` line and exit status 2; runs write outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sim.cli import main
from sim.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--set",
    "cluster.num_gpus=32",
    "--set",
    "workload.prompts_per_step=16",
    "--set",
    "model=qwen3-8b",
    "--set",
    "rollout.tensor_parallel=2",
]


def fails(capsys, argv: list[str]) -> str:
    """Run the CLI, expect a user error, return its message."""
    assert main([*argv, "--quiet", "--no-picture", "--out", "unused-out-dir"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--policy", "fifo"], "unknown policy 'fifo'; valid choices: async, colocated, disaggregated, streaming, tag"),
        (["--set", "workload.kind=chat"], "unknown workload 'chat'; valid choices: math, swe"),
        (
            ["--set", "cluster.device=tpu-v5"],
            "cluster.device: unknown device 'tpu-v5'; valid choices: a100, b200, h100, h20, h200, h800, l40s; "
            "or a path to a device YAML file",
        ),
        (
            ["--set", "model=llama-3-8b"],
            "model: unknown model 'llama-3-8b'; valid choices: llama-3.1-405b, llama-3.1-70b, llama-3.1-8b, "
            "llama-3.3-70b, qwen2.5-0.5b,",
        ),
        (["--set", "cluster.nope=1"], "unknown config key 'cluster.nope'"),
        (["--set", "num_steps=abc"], "config key 'num_steps' must be an integer, got 'abc'"),
        (["--set", "num_steps"], "override 'num_steps' must look like key.path=value"),
        (["--config", "/no/such/file.yaml"], "config file '/no/such/file.yaml' does not exist"),
        (["--config", "/"], "config file '/' is a folder; give a YAML file"),
        (["--set", "costs.sync_fixed_s=-1"], "costs.sync_fixed_s must be a finite number of seconds >= 0, got -1"),
        (["--policy", "tag", "--set", "pools.train_fraction=1.0"], "pools.train_fraction must be in (0, 1), got 1.0"),
        (["--policy", "async", "--set", "cluster.num_gpus=4"], "policy 'async' needs at least 2 resources"),
    ],
)
def test_bad_input_is_one_error_line(capsys, tmp_path, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)  # nothing may be written, even by mistake, into the repository
    assert expected in fails(capsys, argv)
    assert list(tmp_path.iterdir()) == []  # validation happens before any output is written


def test_compare_validates_before_running(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "unknown config key 'cluster.nope'" in fails(capsys, ["--compare", "--set", "cluster.nope=1"])


def test_a_model_too_big_for_inference_says_which_constraint_and_by_how_much(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = fails(
        capsys,
        [
            "--set",
            "model=qwen3-32b",
            "--set",
            "rollout.tensor_parallel=1",
            "--set",
            "cluster.device=a100",
            "--set",
            "rollout.gpu_memory_utilization=0.8",
        ],
    )
    assert "qwen3-32b does not fit for inference" in message
    assert "65.5 GB of weights per GPU" in message and "by 5.5 GB" in message and "tensor_parallel" in message


def test_a_kv_cache_too_small_for_the_longest_request(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = fails(
        capsys, ["--set", "model=qwen3-32b", "--set", "rollout.tensor_parallel=1", "--set", "cluster.device=a100"]
    )
    assert "KV cache of one engine holds" in message and "a request can reach 18432 tokens" in message
    assert "short by" in message


@pytest.mark.parametrize(
    "argv",
    [
        # one 8-GPU resource does both roles: 32B params x 18 bytes / 8 GPUs + gather buffers + activations > 80 GB
        ["--policy", "colocated", "--set", "cluster.num_gpus=8", "--set", "rollout.tensor_parallel=8"],
        # a disaggregated train pool of half of 16 GPUs
        ["--policy", "disaggregated", "--set", "cluster.num_gpus=16"],
    ],
)
def test_a_model_too_big_to_train_says_by_how_much(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    message = fails(capsys, argv)
    assert "qwen3-32b does not fit for training on 8 GPUs: needs 116.6 GB per GPU, 36.6 GB more than" in message
    assert "optimizer state need 73.7 GB per GPU" in message and "add train GPUs" in message


def test_a_run_writes_every_output(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["--policy", "tag", "--out", str(out), "--quiet", "--set", "num_steps=2", *SMALL]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        "intervals.json",
        "summary.json",
        "timeline.json",
        "timeline.png",
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"] == "tag" and summary["num_steps"] == 2
    trace = json.loads((out / "timeline.json").read_text())
    assert trace["traceEvents"]
    assert (out / "timeline.png").read_bytes().startswith(b"\x89PNG")
    # the saved config is the resolved one: loading it reproduces the run's config
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["num_steps"] == 2 and saved["model"] == "qwen3-8b"
    overrides = [a for a in SMALL if a != "--set"] + ["num_steps=2"]
    assert load_config(out / "config.yaml") == load_config(overrides=overrides)
    printed = capsys.readouterr().out
    assert "token throughput (trained-sequence tok/s)" in printed and f"outputs: {out}/" in printed


def test_a_pool_idle_most_of_the_run_gets_a_warning_under_the_summary(capsys, tmp_path):
    """Disaggregated on this small cluster: the train pool waits for every rollout, idle most of the run."""
    out = tmp_path / "run"
    assert (
        main(
            ["--policy", "disaggregated", "--out", str(out), "--quiet", "--no-picture", "--set", "num_steps=2", *SMALL]
        )
        == 0
    )
    idle = 1 - json.loads((out / "summary.json").read_text())["pool_utilisation"]["train"]
    assert idle > 0.5
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("warning:")] == [
        f"warning: under disaggregated, the train pool was idle {idle:.0%} of the time: a larger batch or fewer "
        "train GPUs?"
    ]
    assert lines[-1] == f"outputs: {out}/"  # the warning comes with the summary, before where the outputs are


def test_compare_runs_every_policy_and_writes_ratios(capsys, tmp_path):
    out = tmp_path / "cmp"
    assert main(["--compare", "--out", str(out), "--quiet", "--no-picture", "--set", "num_steps=2", *SMALL]) == 0
    ratios = json.loads((out / "compare.json").read_text())
    assert list(ratios) == ["async", "colocated", "disaggregated", "streaming", "tag"]  # sorted keys
    assert ratios["colocated"] == {"token_throughput": 1.0, "step_time": 1.0}
    for name in ("colocated", "disaggregated", "async", "tag", "streaming"):
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["policy"] == name
        assert not (out / name / "timeline.png").exists()  # --no-picture
    printed = capsys.readouterr().out
    assert "relative to colocated" in printed


def test_python_dash_m_sim_exits_with_status_2_on_bad_input(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sim", "--policy", "fifo", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: unknown policy 'fifo'") and "Traceback" not in result.stderr
