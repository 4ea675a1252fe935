"""Routing in the simulator: `rollout.affinity_slack` routes requests as the runtime's trajectory manager does."""

from __future__ import annotations

import pytest

from core import events as ev
from core.errors import UserError
from reference.manager.router import Router
from sim.engine import SimEngine
from sim.runner import Simulation

TWO_ENGINES = ("cluster.num_gpus=4", "rollout.tensor_parallel=2", "workload.group_size=16")


def _routed(small_config, monkeypatch, *overrides: str) -> list[tuple[str, int]]:
    """(engine, group) of each request of three groups submitted at once to colocated's two engines."""
    seen: list[tuple[str, int]] = []
    offer = SimEngine.offer

    def spy(engine, sample, now):
        seen.append((engine.name, sample.group_id))
        offer(engine, sample, now)

    monkeypatch.setattr(SimEngine, "offer", spy)
    sim = Simulation.from_config(small_config(*TWO_ENGINES, *overrides), "colocated")
    sim.submit(ev.Submit(3))
    return seen


def test_with_an_affinity_slack_the_simulator_routes_as_the_runtimes_router(small_config, monkeypatch):
    seen = _routed(small_config, monkeypatch, "rollout.affinity_slack=2")
    names = sorted({name for name, _ in seen})
    router = Router(dict.fromkeys(names), affinity_slack=2)  # the runtime's router; a group is one session there
    expected = []
    for _, group in seen:
        slot = router.choose(f"g{group}")
        router.acquire(slot)
        expected.append((slot.name, group))
    assert seen == expected
    first = [name for name, group in seen if group == seen[0][1]]
    assert sorted(first.count(n) for n in names) == [7, 9]  # a group's samples in runs, unevenly split


def test_without_it_a_groups_samples_alternate(small_config, monkeypatch):
    seen = _routed(small_config, monkeypatch)
    first = [name for name, group in seen if group == seen[0][1]]
    assert len(set(first)) == 2 and first.count(first[0]) == 8


@pytest.mark.parametrize("value", ["-1", "1.5", "true"])
def test_a_bad_affinity_slack_names_itself(small_config, value):
    with pytest.raises(UserError, match=r"rollout.affinity_slack'? must be (null or )?an integer"):
        small_config(f"rollout.affinity_slack={value}").validate()
