"""The host's work on the devices' cores (`cluster.host_cores`, sim/host.py): the share, and where it slows a run."""

from __future__ import annotations

import pytest

from core.errors import UserError
from sim.host import HostShare, slowdown
from sim.runner import Simulation, simulate

HOST = ("cluster.host_cores=0", "costs.host_token_s=2e-4")


def _ends(timeline) -> list[float]:
    return [s.end_s for s in timeline.steps]


def test_the_share_is_the_runnable_work_over_the_cores():
    assert slowdown(2, 0.5, 2) == pytest.approx(1.25)  # two busy cores and half a core of host work
    assert slowdown(1, 0.5, 2) == 1.0  # the idle core takes the host's work
    assert slowdown(1, 1.5, 2) == pytest.approx(1.25)  # ... as much as it can; the rest is shared
    assert slowdown(4, 1.0, 5) == 1.0  # a core of the host's own
    assert slowdown(0, 3.0, 2) == 1.0  # nothing busy: nothing to slow
    share = HostShare(host_cores=1, total_devices=2, token_s=1e-4)
    assert share.demand(5000.0) == pytest.approx(0.5)
    assert share.slowdown([(1, 0.5), (1, 0.0)]) == 1.0
    assert share.slowdown([(1, 1.5), (1, 1.5)]) == pytest.approx(5 / 3)


def test_without_host_cores_the_host_costs_nothing(run_small, small_config):
    base = run_small("tag")
    assert _ends(simulate(small_config("costs.host_token_s=2e-3"), "tag")) == _ends(base)  # host_cores null
    assert _ends(simulate(small_config("cluster.host_cores=1000", "costs.host_token_s=2e-4"), "tag")) == _ends(base)


def test_host_work_slows_a_machine_whose_devices_all_work_not_one_with_idle_devices(run_small, small_config):
    # Colocated generates on every device: the host's work takes time from them. Disaggregated's trainers wait
    # while its engines generate: their cores take the host's work (here less than they have) for free.
    colocated, slowed = run_small("colocated"), simulate(small_config(*HOST), "colocated")
    assert _ends(slowed)[-1] > 1.02 * _ends(colocated)[-1]
    assert _ends(simulate(small_config(*HOST), "disaggregated")) == _ends(run_small("disaggregated"))
    # More host work a token: slower still, and now more than the idle devices can take.
    heavier = ("cluster.host_cores=0", "costs.host_token_s=2e-3")
    assert _ends(simulate(small_config(*heavier), "colocated"))[-1] > _ends(slowed)[-1]
    assert _ends(simulate(small_config(*heavier), "disaggregated"))[-1] > _ends(run_small("disaggregated"))[-1]


def test_the_slowdown_follows_the_busy_devices(small_config):
    sim = Simulation(small_config(*HOST), "colocated")
    assert sim.host_slowdown() == 1.0  # nothing runs yet
    sim._training.update(sim.resources)  # every device trains, the host has no tokens to stream
    assert sim.host_slowdown() == 1.0
    engine = sim._by_index[0]
    from sim.engine import EngineState

    engine.state, engine.host_demand = EngineState.RUNNING, 4.0  # and one engine's tokens need 4 cores
    devices = sim.cfg.total_gpus + sim.resources[engine.name].devices
    assert sim.host_slowdown() == pytest.approx((devices + 4.0) / sim.cfg.total_gpus)


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.host_cores=-1", "cluster.host_cores must be null or an integer >= 0, got -1"),
        ("cluster.host_cores=1.5", "cluster.host_cores. must be an integer, got 1.5"),
        ("costs.host_token_s=-1e-4", "costs.host_token_s must be a finite number >= 0, got -0.0001"),
        ("costs.host_token_s=.nan", "costs.host_token_s must be a finite number >= 0, got nan"),
        ("costs.train_dp_overhead_s=-0.5", "costs.train_dp_overhead_s must be a finite number >= 0, got -0.5"),
    ],
)
def test_bad_host_settings_name_themselves(small_config, override, message):
    with pytest.raises(UserError, match=message):
        small_config(override)


def _train_s(timeline) -> float:
    return sum(s.end_s - s.start_s for s in timeline.steps)


def test_a_training_step_follows_the_share_while_it_runs(run_small, small_config):
    """A training step is re-timed whenever the share changes, not priced at its start alone: `async`'s trainer
    takes a batch while the engines are idle and the next batch's rollout starts just after, so the host's work
    slows nearly all of the step (priced at its start, the step ran at full speed). Disaggregated's training,
    with every engine waiting, is not slowed."""
    slowed = simulate(small_config(*HOST), "async")
    assert _train_s(slowed) > 1.05 * _train_s(run_small("async"))
    assert _train_s(simulate(small_config(*HOST), "disaggregated")) == _train_s(run_small("disaggregated"))
    # A step's record ends where the re-timed step ends: the next step cannot start before it.
    assert all(a.end_s <= b.start_s for a, b in zip(slowed.steps, slowed.steps[1:], strict=False))
