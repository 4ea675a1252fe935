"""`python -m sim --tensorboard DIR`: each simulated step's figures as TensorBoard scalars."""

from __future__ import annotations

import json
import sys

import pytest

from sim.cli import main

SMALL = ["--set", "cluster.num_gpus=32", "--set", "workload.prompts_per_step=16", "--set", "model=qwen3-8b",
         "--set", "rollout.tensor_parallel=2", "--set", "num_steps=3", "--quiet", "--no-picture"]  # fmt: skip


def test_each_simulated_step_is_a_tensorboard_scalar(tmp_path, capsys):
    pytest.importorskip("tensorboardX")
    from core.run_log import read_scalars

    assert main([*SMALL, "--compare", "--out", str(tmp_path / "o"), "--tensorboard", str(tmp_path / "tb")]) == 0
    for policy in ("colocated", "tag"):
        found = read_scalars(tmp_path / "tb" / policy)
        assert [step for step, _ in found["train/sequence_tokens_per_s"]] == [1, 2, 3]
        summary = json.loads((tmp_path / "o" / policy / "summary.json").read_text())
        last = found["train/sequence_tokens_per_s"][-1][1]  # the summary's token throughput: whole sequences
        assert last == pytest.approx(summary["token_throughput"], rel=1e-3)
        gen = found["train/gen_tokens_per_s"][-1][1]  # generated tokens only, as the runtime's line counts
        assert gen == pytest.approx(summary["generated_token_throughput"], rel=1e-3)
        assert {"train/staleness_mean", "train/step_s", "train/trained_tokens"} <= set(found)


def test_without_tensorboardx_it_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    assert main([*SMALL, "--out", str(tmp_path / "o"), "--tensorboard", str(tmp_path / "tb")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --tensorboard needs the tensorboardX package: pip install tensorboardX (or pip install -e "
        "'.[tensorboard]')"
    ]
    assert list(tmp_path.iterdir()) == []
