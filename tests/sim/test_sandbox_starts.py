"""`workload.sandbox_start_s`: a SWE episode's containers start in a queue of `sandbox_start_slots` lanes."""

from __future__ import annotations

import pytest

from core.errors import UserError
from sim.config import Dist, load_config
from sim.runner import simulate
from sim.workload import SandboxStarts

SWE = "sim/configs/swe.yaml"
SMALL = ("num_steps=2", "cluster.num_gpus=8", "workload.prompts_per_step=4", "workload.group_size=4",
         "model=qwen3-8b", "rollout.tensor_parallel=2")  # fmt: skip


class _Cfg:
    def __init__(self, seconds: float, slots: int) -> None:
        self.sandbox_start_s = Dist(seconds, 0.0, seconds, seconds)
        self.sandbox_start_slots = slots


def test_starts_queue_in_order_on_their_lanes():
    one = SandboxStarts(_Cfg(1.0, 1), 0)
    assert [one.start(0.0) for _ in range(3)] == [1.0, 2.0, 3.0]
    assert one.start(10.0) == 11.0  # an idle lane starts at once
    two = SandboxStarts(_Cfg(1.0, 2), 0)
    assert [two.start(0.0) for _ in range(3)] == [1.0, 1.0, 2.0]


def _run(policy: str, *overrides: str):
    return simulate(load_config(SWE, [*SMALL, *overrides]), policy)


@pytest.mark.parametrize("policy", ["colocated", "tag"])
def test_queued_starts_slow_episodes_and_change_no_episode(policy):
    free = _run(policy)
    start = "workload.sandbox_start_s={median: 2.0, sigma: 0.0, min: 2.0, max: 2.0}"
    queued = _run(policy, start, "workload.sandbox_start_slots=1")
    parallel = _run(policy, start, "workload.sandbox_start_slots=64")
    # the same episodes (their lengths come from the workload's own stream), trained in the same steps
    assert [s.tokens for s in queued.steps] == [s.tokens for s in free.steps] == [s.tokens for s in parallel.steps]
    # 16 episodes a step, each with a workspace and a grader: one lane makes them wait for each other
    assert free.steps[-1].end_s < parallel.steps[-1].end_s < queued.steps[-1].end_s


def test_bad_sandbox_settings_name_themselves():
    with pytest.raises(UserError, match="workload.sandbox_start_s needs median > 0"):
        load_config(SWE, [*SMALL, "workload.sandbox_start_s={median: 0, sigma: 0, min: 0, max: 0}"]).validate()
    with pytest.raises(UserError, match="workload.sandbox_start_slots must be >= 1, got 0"):
        load_config(SWE, [*SMALL, "workload.sandbox_start_slots=0"]).validate()


# ---- workload.sandbox_busy_stretch: sandboxes slowed by busy cores where the devices are the host's cores ----


def test_busy_cores_stretch_sandbox_work_only_where_the_devices_are_the_hosts_cores():
    start = "workload.sandbox_start_s={median: 1.0, sigma: 0.0, min: 1.0, max: 1.0}"
    ends = {}
    for cores in ("null", "0"):
        for stretch in (1.0, 2.0, 4.0):
            run = _run("colocated", start, f"cluster.host_cores={cores}", f"workload.sandbox_busy_stretch={stretch}")
            ends[cores, stretch] = (run.steps[-1].end_s, [s.tokens for s in run.steps])
    # a GPU cluster's sandboxes run on CPUs of their own: no effect at all
    assert ends["null", 1.0] == ends["null", 2.0] == ends["null", 4.0]
    # devices that are the host's cores: the same episodes, longer the more a busy core slows a sandbox
    assert ends["0", 1.0] == ends["null", 1.0]
    assert ends["0", 1.0][1] == ends["0", 2.0][1] == ends["0", 4.0][1]
    assert ends["0", 1.0][0] < ends["0", 2.0][0] < ends["0", 4.0][0]


@pytest.mark.parametrize("bad", ["0.5", ".nan", ".inf", "true", "fast"])
def test_a_bad_busy_stretch_names_itself(bad):
    with pytest.raises(UserError, match=r"workload.sandbox_busy_stretch'? must be a"):
        load_config(SWE, [*SMALL, f"workload.sandbox_busy_stretch={bad}"]).validate()


# ---- workload.sandbox_cpu_cores: the sandboxes at work share what the host's cores have left ----


def test_the_sandboxes_share_the_idle_cores_and_half_of_each_busy_one():
    from sim.host import sandbox_rate

    assert sandbox_rate(0, 2, 0.0, 1.5) == 1.0  # two idle cores: room for it all
    assert sandbox_rate(2, 2, 0.0, 1.0) == 1.0  # two busy cores give the host at most one
    assert sandbox_rate(2, 2, 0.0, 4.0) == 0.25  # 20 sandboxes of 0.2 cores share that one
    assert sandbox_rate(1, 2, 0.5, 2.5) == 0.5  # 1.5 cores for 3 asked, the host's other work included
    assert sandbox_rate(0, 8, 0.0, 0.0) == 1.0


def test_many_sandboxes_at_once_slow_each_other_where_the_devices_are_the_hosts_cores():
    start = "workload.sandbox_start_s={median: 1.0, sigma: 0.0, min: 1.0, max: 1.0}"
    base = _run("colocated", start, "cluster.host_cores=0")
    assert _run("colocated", start, "workload.sandbox_cpu_cores=0.5").steps == _run("colocated", start).steps
    light = _run("colocated", start, "cluster.host_cores=0", "workload.sandbox_cpu_cores=0.01")
    heavy = _run("colocated", start, "cluster.host_cores=0", "workload.sandbox_cpu_cores=0.5")
    assert [s.tokens for s in light.steps] == [s.tokens for s in base.steps] == [s.tokens for s in heavy.steps]
    # 16 episodes' sandboxes on 8 cores: at 0.01 cores each they fit beside busy devices (whose work their CPU
    # slows a little when every core is busy); at 0.5 they do not, and each runs slower
    assert base.steps[-1].end_s <= light.steps[-1].end_s < 1.01 * base.steps[-1].end_s
    assert heavy.steps[-1].end_s > 1.05 * light.steps[-1].end_s


@pytest.mark.parametrize("bad", ["0", "-1", ".nan", "true", "many"])
def test_a_bad_sandbox_cpu_names_itself(bad):
    with pytest.raises(UserError, match=r"workload.sandbox_cpu_cores'? must be"):
        load_config(SWE, [*SMALL, f"workload.sandbox_cpu_cores={bad}"]).validate()
