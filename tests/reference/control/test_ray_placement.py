"""Where a run's workers go and what they ask Ray for: pinned cores on a local Ray, CPUs by count on a cluster it
joins; and what a cluster that cannot hold them is told, as one line, before the start timeout."""

from __future__ import annotations

import os

import pytest

from core.policies import make_policy
from reference.control.config import load_train_config, policy_config
from reference.control.layout import worker_specs
from reference.control.worker import WorkerSpec

pytest.importorskip("ray")

from reference.ray.workers import demand, placement_problem  # noqa: E402 - needs ray


def _specs(*overrides: str) -> list[WorkerSpec]:
    cfg = load_train_config(None, ["policy.name=tag", "resources.count=2", *overrides])
    n = cfg.resources.count
    policy = make_policy(cfg.policy.name, policy_config(cfg, cfg.policy.num_steps), n, cfg.resources.train_fraction, 1)
    return worker_specs(cfg, policy, "unused")


def _node(alive: bool = True, **resources: float) -> dict:
    return {"Alive": alive, "Resources": {"node:10.0.0.1": 1.0, "memory": 1e9, **resources}}


def test_on_a_local_ray_each_worker_is_pinned_to_its_own_cores():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    specs = _specs("resources.cores_per_resource=1")
    cores = sorted(os.sched_getaffinity(0))
    assert [s.cores for s in specs] == [(cores[0],), (cores[1],)]
    assert [s.threads for s in specs] == [1, 1]
    assert [demand(s)["CPU"] for s in specs] == [1.0, 1.0]


def test_on_a_cluster_each_worker_asks_ray_for_its_cores_and_runs_as_many_threads():
    """On a cluster the cores are the nodes', not this machine's: nothing is pinned, and cores_per_resource is
    what each worker asks Ray for and how many torch threads it runs (it used to ask for one CPU whatever was set,
    and run one thread)."""
    specs = _specs("resources.cores_per_resource=8", "run.ray_address=10.0.0.1:6379")
    assert [s.cores for s in specs] == [(), ()]
    assert [s.threads for s in specs] == [8, 8]
    assert [demand(s) for s in specs] == [{"CPU": 8.0, "rollout": 1.0}, {"CPU": 8.0, "rollout": 1.0, "train": 1.0}]


def test_a_cluster_that_holds_the_workers_has_no_problem():
    specs = _specs("resources.cores_per_resource=4", "run.ray_address=auto")
    nodes = [_node(CPU=8, rollout=1), _node(CPU=4, rollout=1, train=1), _node(alive=False)]
    assert placement_problem(specs, nodes) is None


def test_a_worker_no_node_can_hold_is_named_with_what_it_asks_and_what_the_nodes_offer():
    specs = _specs("resources.cores_per_resource=4", "run.ray_address=auto")
    nodes = [_node(CPU=16, rollout=4), _node(CPU=2, rollout=1, train=1), _node(CPU=2, rollout=1, train=1)]
    problem = placement_problem(specs, nodes)
    assert problem == (
        "no node of the Ray cluster offers what worker T00 asks for (CPU 4, rollout 1, train 1; CPUs are "
        "resources.cores_per_resource); its nodes offer: 1 x (CPU 16, rollout 4); 2 x (CPU 2, rollout 1, train 1)"
    )


def test_workers_each_placeable_but_not_all_at_once_are_named_by_the_total():
    specs = _specs("resources.count=3", "policy.name=colocated", "run.ray_address=auto")  # three rollout+train
    nodes = [_node(CPU=8, rollout=2, train=2)]
    assert placement_problem(specs, nodes) == (
        "the run's workers ask the Ray cluster for rollout 3 in all; its nodes offer 2: 1 x (CPU 8, rollout 2, train 2)"
    )


def test_a_cluster_with_no_live_node_says_so():
    specs = _specs("run.ray_address=auto")
    problem = placement_problem(specs, [_node(alive=False, CPU=8, rollout=1, train=1)])
    assert problem is not None and problem.endswith("its nodes offer: none alive")
