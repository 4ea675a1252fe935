"""The host's work on the devices' cores (`cluster.host_cores`, sim/host.py): the share, and where it slows a run."""

from __future__ import annotations

import pytest

from core.errors import UserError
from sim.host import HostShare, slowdowns
from sim.runner import Simulation, simulate

HOST = ("cluster.host_cores=0", "costs.host_token_s=2e-4")


def _ends(timeline) -> list[float]:
    return [s.end_s for s in timeline.steps]


def test_the_host_runs_on_idle_cores_first_then_takes_time_from_busy_ones():
    assert slowdowns(1, 1, 0.5, 2) == pytest.approx((4 / 3, 4 / 3))  # half a core over two busy: 1 / (1 - 0.25)
    assert slowdowns(1, 0, 0.5, 2) == (1.0, 1.0)  # the idle core takes the host's work
    assert slowdowns(0, 1, 1.5, 2) == pytest.approx((2.0, 2.0))  # ... as much as it can: half a core is left
    assert slowdowns(0, 1, 1.2, 2) == pytest.approx((1.25, 1.25))  # 0.2 of a core on the busy one
    assert slowdowns(2, 2, 1.0, 5) == (1.0, 1.0)  # a core of the host's own
    assert slowdowns(0, 0, 3.0, 2) == (1.0, 1.0)  # nothing busy: nothing to slow
    assert slowdowns(1, 1, 9.0, 2) == (2.0, 2.0)  # a busy device keeps half its core however much the host needs
    share = HostShare(host_cores=1, total_devices=2, token_s=1e-4)
    assert share.demand(5000.0) == pytest.approx(0.5)
    assert share.slowdowns([(1, 0.5, False), (1, 0.0, True)]) == (1.0, 1.0)
    assert share.slowdowns([(1, 1.2, False), (1, 0.3, True)]) == pytest.approx((4 / 3, 4 / 3))


def test_the_placement_sends_the_spill_to_training_cores_as_measured():
    # One training and one rollout core busy, 0.3 of a core to place: 0.9 of it on the training core.
    train, other = slowdowns(1, 1, 0.3, 2, train_placement=0.9)
    assert train == pytest.approx(1 / (1 - 0.27)) and other == pytest.approx(1 / (1 - 0.03))
    # Two rollout cores and one training core: weights 0.1 + 0.1 + 0.9.
    train, other = slowdowns(1, 2, 0.55, 3, train_placement=0.9)
    assert train == pytest.approx(1 / (1 - 0.45)) and other == pytest.approx(1 / (1 - 0.05))
    # Only one kind busy: the placement has nothing to choose, even at its ends.
    assert slowdowns(0, 2, 0.4, 2, train_placement=1.0) == pytest.approx((1.25, 1.25))
    assert slowdowns(2, 0, 0.4, 2, train_placement=0.0) == pytest.approx((1.25, 1.25))


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
    sim = Simulation.from_config(small_config(*HOST), "colocated")
    assert sim.host_slowdown() == 1.0  # nothing runs yet
    sim.host_load.training.update(sim.resources)  # every device trains, the host has no tokens to stream
    assert sim.host_slowdown() == 1.0
    engine = next(iter(sim.engines.values()))
    from sim.engine import EngineState

    sim.host_load.training.discard(engine.name)  # the others train while its tokens need half a core
    engine.state, engine.host_demand = EngineState.RUNNING, 0.5
    cores = sim.cfg.total_gpus  # every device busy and no core of the host's own: 0.5 spread over all of them
    assert sim.host_slowdown() == sim.host_slowdown(training=True) == pytest.approx(1 / (1 - 0.5 / cores))
    sim.host_load.training.clear()  # only the engine busy: the idle devices take the half core
    assert sim.host_slowdown() == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.host_cores=-1", "cluster.host_cores must be null or an integer >= 0, got -1"),
        ("cluster.host_cores=1.5", "cluster.host_cores. must be an integer, got 1.5"),
        ("costs.host_token_s=-1e-4", "costs.host_token_s must be a finite number >= 0, got -0.0001"),
        ("costs.host_token_s=.nan", "costs.host_token_s must be a finite number >= 0, got nan"),
        ("costs.train_dp_overhead_s=-0.5", "costs.train_dp_overhead_s must be a finite number >= 0, got -0.5"),
        ("costs.host_train_placement=1.5", "costs.host_train_placement must be a number from 0 to 1, got 1.5"),
        ("costs.host_train_placement=.nan", "costs.host_train_placement must be a number from 0 to 1, got nan"),
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
