"""`rollout.max_concurrency`: the simulator runs groups in the runtime's rollout manager's slots."""

from __future__ import annotations

import pytest

from core import events as ev
from core.errors import UserError
from sim.runner import Simulation, simulate


def _live(sim: Simulation) -> set[int]:
    """Groups with a sample that started (queued, on an engine, waiting for a tool) and is not done."""
    return {s.group_id for g in sim.groups.values() for s in g if s.where not in ("pending", "done")}


def test_groups_beyond_the_slots_wait_in_order(small_config, monkeypatch):
    cfg = small_config("workload.group_size=4", "rollout.max_concurrency=9")  # 9 // 4: two slots
    sim = Simulation.from_config(cfg, "colocated")
    most: list[int] = []
    run = Simulation._run

    def spy(self, gid, samples):
        run(self, gid, samples)
        most.append(len(_live(self)))

    monkeypatch.setattr(Simulation, "_run", spy)
    sim.submit(ev.Submit(5))
    first = sorted(sim.groups)[:2]
    assert _live(sim) == set(first)  # the first two started, the other three wait
    assert [gid for gid, _ in sim._waiting] == sorted(sim.groups)[2:]
    assert all(s.where == "pending" for gid, _ in sim._waiting for s in sim.groups[gid])


@pytest.mark.parametrize("policy", ["colocated", "disaggregated", "async", "tag", "streaming"])
def test_a_capped_run_finishes_and_never_runs_more_groups_than_its_slots(small_config, monkeypatch, policy):
    seen: list[int] = []
    release = Simulation._release

    def spy(self, gid):
        release(self, gid)
        if self._slots is not None:
            seen.append(len(_live(self)))

    monkeypatch.setattr(Simulation, "_release", spy)
    capped = simulate(small_config("rollout.max_concurrency=16"), policy)  # one group of 16 at a time
    free = simulate(small_config(), policy)
    assert seen and max(seen) <= 1
    assert len(capped.steps) == len(free.steps)
    # one group at a time leaves the engines' batches small: the run takes longer
    assert capped.steps[-1].end_s > free.steps[-1].end_s


def test_without_a_cap_every_group_starts_at_once(small_config):
    sim = Simulation.from_config(small_config("workload.group_size=4"), "colocated")
    sim.submit(ev.Submit(5))
    assert len(_live(sim)) == 5 and not sim._waiting


@pytest.mark.parametrize("value", ["0", "1.5", "true"])
def test_a_bad_max_concurrency_names_itself(small_config, value):
    with pytest.raises(UserError, match=r"rollout.max_concurrency'? must be (null or )?an integer"):
        small_config(f"rollout.max_concurrency={value}").validate()
