"""The simulator as an executor of the shared driver (core.driver): its methods, and a stalled run's
error naming the decisions it waits for."""

from __future__ import annotations

import re

import pytest

from core.driver import Driver
from sim.runner import Simulation

EXECUTOR_METHODS = (
    "now",
    "submit",
    "preempt",
    "switch_tag",
    "start_train",
    "refresh",
    "sync_weights",
    "resume_rollout",
)


def test_the_simulator_runs_the_shared_driver(small_config):
    sim = Simulation.from_config(small_config("num_steps=1"), "tag")
    assert isinstance(sim.driver, Driver) and sim.driver.policy is sim.policy and sim.driver.executor is sim
    assert all(callable(getattr(sim, name)) for name in EXECUTOR_METHODS)
    timeline = sim.run()
    assert sim.policy.done and [s.step for s in timeline.steps] == [0]


def test_a_stalled_simulation_names_the_decisions_it_waits_for(small_config):
    sim = Simulation.from_config(small_config("num_steps=1", "cluster.num_gpus=4"), "colocated")
    sim.switch_tag = lambda decision: None  # a switch that never finishes
    message = (
        "outstanding decisions: SwitchTag(resource='C00', active=Tag.TRAIN), "
        "SwitchTag(resource='C01', active=Tag.TRAIN))"
    )
    with pytest.raises(RuntimeError, match=r"simulation stalled at t=[\d.]+s after 0 steps: .*" + re.escape(message)):
        sim.run()
