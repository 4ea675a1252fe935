"""Shared fixtures: a small simulator config that runs each policy in a fraction of a second."""

from __future__ import annotations

from functools import cache

import pytest

from core.timeline import Timeline
from sim.config import SimConfig, load_config
from sim.runner import simulate

# 16 engines of 2 x H800 running Qwen3-8B, 16 prompt groups of 16 samples a step: big enough for the
# policies to differ (queues, stragglers, pipelining), small enough for the whole suite to stay fast.
SMALL = (
    "num_steps=4",
    "cluster.num_gpus=32",
    "workload.prompts_per_step=16",
    "model=qwen3-8b",
    "rollout.tensor_parallel=2",
)


@pytest.fixture(scope="session")
def small_config():
    """`small_config(*overrides)`: the small config with further `key=value` overrides applied."""

    def make(*overrides: str) -> SimConfig:
        return load_config(overrides=[*SMALL, *overrides])

    return make


@pytest.fixture(scope="session")
def run_small(small_config):
    """`run_small(policy, *overrides)`: the timeline of one simulation of the small config, cached for
    the session (tests only read timelines)."""

    @cache
    def run(policy: str, *overrides: str) -> Timeline:
        return simulate(small_config(*overrides), policy)

    return run
