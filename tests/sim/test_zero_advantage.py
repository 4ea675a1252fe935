"""`train.zero_advantage_share`: samples with no gradient run forward only in the first pass, not at all later."""

from __future__ import annotations

import pytest

from core import specs
from core.errors import UserError
from sim import train_layout
from sim.config import load_config

SMALL = ("cluster.num_gpus=8", "model=qwen3-8b")


def _step(*overrides: str):
    cfg = load_config(overrides=[*SMALL, *overrides])
    return train_layout.step(cfg, specs.model(cfg.model), specs.device(cfg.cluster.device), [4096] * 64, 8)


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_sample_without_gradient_costs_a_third_in_the_first_pass_and_nothing_later(epochs):
    full = _step(f"train.ppo_epochs={epochs}", "train.recompute_logprobs=false")
    half = _step(f"train.ppo_epochs={epochs}", "train.recompute_logprobs=false", "train.zero_advantage_share=0.5")
    none = _step(f"train.ppo_epochs={epochs}", "train.recompute_logprobs=false", "train.zero_advantage_share=1.0")
    kept = {1: (0.5 + 0.5 / 3), 2: (0.5 + 0.5 / 3 + 0.5) / 2}[epochs]
    assert half.train_compute_s == pytest.approx(full.train_compute_s * kept)
    assert none.train_compute_s == pytest.approx(full.train_compute_s / 3 / epochs)
    # the optimiser still steps, and the gradients' reduction stays whole
    assert half.optimizer_s == full.optimizer_s and half.dp_exposed_s == full.dp_exposed_s
    assert half.total_s < full.total_s


def test_zero_by_default_changes_nothing():
    assert _step() == _step("train.zero_advantage_share=0.0")


@pytest.mark.parametrize("bad", ["-0.1", "1.5", ".nan", "true", "most"])
def test_a_bad_share_names_itself(bad):
    with pytest.raises(UserError, match=r"train.zero_advantage_share'? must be"):
        load_config(overrides=[*SMALL, f"train.zero_advantage_share={bad}"])
