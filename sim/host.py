"""The host's work on the devices' own cores (`cluster.host_cores` set): what slows a CPU runtime's resources.

On a GPU cluster the processes that feed the engines and the trainers (the trajectory manager streaming
tokens, the rollout manager grading and recording, the driver) run on CPU cores the GPUs do not need, so
they cost the devices nothing and the simulator leaves them out (`cluster.host_cores: null`). When the
devices are themselves CPU cores, as in the runtime on this machine, those processes take their cores from
the same pool: a core that generates or trains also runs the host's work whenever no other core is free.

The model is a fluid share of the cores. The host's demand H, in cores, is what the running engines'
tokens cost it: `costs.host_token_s` CPU-seconds a generated token times each engine's rate at full speed.
With B devices busy (generating, training or loading weights) and C = `host_cores` + every device of the
cluster, the host runs first on the cores nothing else uses (idle devices and its own); when B + H exceeds
C, every busy device runs at C / (B + H) of its speed, so it takes `slowdown()` = (B + H) / C times as
long (at least 1). That is the operating system's scheduler sharing the cores evenly among the runnable
processes, with the devices' processes pinned and the host's free to run anywhere. The engines' rates
are taken at full speed, so H is what the host would need if it kept up; a slowed engine makes its tokens
more slowly and needs less (a bound, not a fixed point). An engine's stretch between two events and a sync
are timed with the share at their start (a change meanwhile takes effect at the next one; both are short); a
training step, long next to them, is re-timed at every change (`Simulation.host_share_changed`): the work done
so far at the old share, the rest at the new one.
"""

from __future__ import annotations

from collections.abc import Iterable


def slowdown(busy_devices: int, host_demand_cores: float, total_cores: int) -> float:
    """How many times longer a busy device's work takes: (busy + demand) / cores, at least 1."""
    if busy_devices <= 0 or total_cores <= 0:
        return 1.0
    return max(1.0, (busy_devices + host_demand_cores) / total_cores)


class HostShare:
    """The share of the cores the devices' work gets, from the cluster's state (`Simulation.host_slowdown`)."""

    def __init__(self, host_cores: int, total_devices: int, token_s: float) -> None:
        self.total_cores = host_cores + total_devices
        self.token_s = token_s

    def demand(self, tokens_per_s: float) -> float:
        """Cores of host work that an engine generating `tokens_per_s` tokens a second needs."""
        return self.token_s * tokens_per_s

    def slowdown(self, busy: Iterable[tuple[int, float]]) -> float:
        """`busy`: (devices, host demand in cores) of every resource at work now."""
        devices, demand = 0, 0.0
        for n, cores in busy:
            devices += n
            demand += cores
        return slowdown(devices, demand, self.total_cores)
