"""How fast is the simulator? Prints wall time, simulated events per second, and scaling.

Targets (2-core machine): the default config (Qwen3-32B, math, 64 H800) for 20 steps in under 10 s
per policy, and a 512-GPU SWE-workload run of 20 steps in under 60 s; wall time should grow about
linearly with cluster size when the work per GPU is fixed (weak scaling).

    python -m benchmarks.sim_speed [--skip-512]
"""

from __future__ import annotations

import argparse
import time

from core.policies import POLICIES
from sim.config import CONFIG_DIR, load_config
from sim.runner import Simulation


def timed(cfg, policy: str) -> tuple[float, int, float]:
    """(wall seconds, simulated events, simulated seconds) for one run."""
    sim = Simulation(cfg, policy)
    start = time.perf_counter()
    timeline = sim.run()
    return time.perf_counter() - start, sim.events_scheduled, timeline.wall_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-512", action="store_true", help="skip the 512-GPU SWE run")
    args = p.parse_args()

    print("default config (qwen3-32b, math, 64 x h800), 20 steps")
    print(f"  {'policy':<14} {'wall s':>8} {'events':>9} {'events/s':>9} {'target':>8}")
    for policy in POLICIES:
        wall, events, _ = timed(load_config(), policy)
        print(f"  {policy:<14} {wall:8.2f} {events:9d} {events / wall:9.0f} {'< 10 s':>8}")

    if not args.skip_512:
        cfg = load_config(CONFIG_DIR / "swe.yaml", ["cluster.num_gpus=512"])
        wall, events, sim_s = timed(cfg, "tag")
        print(
            f"swe workload, 512 x h800, 20 steps, tag: {wall:.1f} s wall, {events} events "
            f"({events / wall:.0f}/s), {sim_s / 3600:.1f} simulated hours (target < 60 s)"
        )

    print("weak scaling: swe workload, tag, 8 steps, prompts per step proportional to GPUs")
    print(f"  {'gpus':>5} {'wall s':>8} {'events':>9} {'wall s per 64 GPUs':>19}")
    for gpus in (64, 128, 256, 512):
        cfg = load_config(
            CONFIG_DIR / "swe.yaml",
            [f"cluster.num_gpus={gpus}", f"workload.prompts_per_step={gpus // 8}", "num_steps=8"],
        )
        wall, events, _ = timed(cfg, "tag")
        print(f"  {gpus:5d} {wall:8.2f} {events:9d} {wall * 64 / gpus:19.2f}")


if __name__ == "__main__":
    main()
