"""The host's work on the devices' own cores (`cluster.host_cores` set): what slows a CPU runtime's resources.

On a GPU cluster the processes that feed the engines and the trainers (the trajectory manager streaming
tokens, the rollout manager grading and recording, the driver) run on CPU cores the GPUs do not need, so
they cost the devices nothing and the simulator leaves them out (`cluster.host_cores: null`). When the
devices are themselves CPU cores, as in the runtime on this machine, those processes take their cores from
the same pool: a core that generates or trains also runs the host's work whenever no other core is free.

The host's demand H, in cores, is what the running engines' tokens cost it: `costs.host_token_s`
CPU-seconds a generated token times each engine's rate at full speed. With C = `host_cores` + every device
of the cluster and B devices busy (generating, training or loading weights), the host runs first on the
C - B cores nothing else uses (idle devices and its own); what is left, S = H - (C - B), runs on the busy
devices' cores. It does not spread evenly: the operating system places the host's unpinned processes by
its own rules, and on the runtime a busy training core takes most of it (`make validate` measures the split
as `costs.host_train_placement`, p: a busy training core takes p parts for every 1 - p parts a busy rollout
or syncing core takes; 0.5 is an even spread). A busy core carrying h cores of the host's work gives its
device 1 - h of itself (the scheduler shares the core in time), so the device's work takes 1 / (1 - h) times
as long; h is capped at one half (a device's process keeps at least its fair share of two runnable ones).

A SWE workload's sandboxes are host work too (`workload.sandbox_cpu_cores`: the cores one uses while it runs
alone, the Docker daemon, its container and the client together): the sandboxes at work add their demand to
H, and when the host's work asks more than it can have (the idle cores and half of each busy one) its parts
share that in proportion, so each sandbox runs at that share of its speed alone (`sandbox_rate`): 32
episodes' tool calls at once on two busy cores each take several times as long as one alone. A sandbox's
work is timed with the share at its start, as an engine's stretch is.

The engines' rates are taken at full speed, so H is what the host would need if it kept up; a slowed engine
makes its tokens more slowly and needs less (a bound, not a fixed point). An engine's stretch between two
events and a sync are timed with the share at their start (a change meanwhile takes effect at the next one;
both are short); a training step, long next to them, is re-timed at every change
(`HostLoad.changed`, sim/host_load.py): the work done so far at the old share, the rest at the new one.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_HOST_SHARE = 0.5  # of one busy core: a device's process keeps at least half its core


def slowdowns(
    training: int, other: int, host_demand_cores: float, total_cores: int, train_placement: float = 0.5
) -> tuple[float, float]:
    """(slowdown of a busy training device, of a busy rollout or syncing device): how many times longer their
    work takes with `training` and `other` devices busy, `host_demand_cores` of the host's work and
    `total_cores` cores in all, a training core taking `train_placement` parts of the host's spill for each
    1 - `train_placement` an other core takes. 1 where the idle cores hold the host's work."""
    busy = training + other
    spill = host_demand_cores - (total_cores - busy)
    if busy <= 0 or spill <= 0:
        return 1.0, 1.0
    weights = training * train_placement + other * (1.0 - train_placement)
    if weights <= 0:  # every busy core is of the kind that takes none: they share it evenly
        per_train = per_other = spill / busy
    else:
        per_train, per_other = spill * train_placement / weights, spill * (1.0 - train_placement) / weights
    return _stretch(per_train), _stretch(per_other)


def sandbox_rate(busy_devices: int, total_cores: int, token_demand: float, sandbox_demand: float) -> float:
    """The speed, as a share of running alone, of the sandboxes' work when it asks `sandbox_demand` cores in all
    (`workload.sandbox_cpu_cores` for each sandbox at work) beside `token_demand` cores of the host's other work,
    with `busy_devices` of `total_cores` cores busy: the host's work has the idle cores and at most
    `MAX_HOST_SHARE` of each busy one, and its parts share that in proportion to what they ask."""
    capacity = (total_cores - busy_devices) + MAX_HOST_SHARE * busy_devices
    demand = token_demand + sandbox_demand
    return 1.0 if demand <= capacity else max(0.0, capacity) / demand


def _stretch(host_cores: float) -> float:
    return 1.0 / (1.0 - min(MAX_HOST_SHARE, host_cores))


class HostShare:
    """The share of the cores the devices' work gets, from the cluster's state (`Simulation.host_slowdown`)."""

    def __init__(self, host_cores: int, total_devices: int, token_s: float, train_placement: float = 0.5) -> None:
        self.total_cores = host_cores + total_devices
        self.token_s = token_s
        self.train_placement = train_placement

    def demand(self, tokens_per_s: float) -> float:
        """Cores of host work that an engine generating `tokens_per_s` tokens a second needs."""
        return self.token_s * tokens_per_s

    def slowdowns(self, busy: Iterable[tuple[int, float, bool]]) -> tuple[float, float]:
        """`busy`: (devices, host demand in cores, whether it trains) of every resource at work now; the
        slowdown of a training device and of any other busy one."""
        training, other, demand = 0, 0, 0.0
        for n, cores, trains in busy:
            if trains:
                training += n
            else:
                other += n
            demand += cores
        return slowdowns(training, other, demand, self.total_cores, self.train_placement)
