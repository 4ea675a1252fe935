"""How fast is the simulator? Prints wall time, simulated events per second, and scaling.

Targets (2-core machine): the default config (Qwen3-32B, math, 64 H800) for 20 steps in under 2 s
per policy; a 4,096-GPU SWE-workload run of 20 steps in under 60 s; a 100-candidate layout search
(`python -m sim search`) in under 2 minutes. Wall time should grow about linearly with cluster size
when the work per GPU is fixed (weak scaling) and with the number of steps.

    python -m benchmarks.sim_speed [--skip-big] [--skip-search]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

from core.policies import POLICIES
from sim.config import CONFIG_DIR, load_config
from sim.runner import Simulation


def timed(cfg, policy: str) -> tuple[float, int, float]:
    """(wall seconds, simulated events, simulated seconds) for one run."""
    sim = Simulation.from_config(cfg, policy)
    start = time.perf_counter()
    timeline = sim.run()
    return time.perf_counter() - start, sim.events_scheduled, timeline.wall_s


def swe(gpus: int, steps: int, per_gpu: bool = True):
    """The SWE config on `gpus` GPUs; with `per_gpu`, prompts per step proportional to GPUs (8 GPUs a task)."""
    overrides = [f"cluster.num_gpus={gpus}", f"num_steps={steps}"]
    if per_gpu:
        overrides.append(f"workload.prompts_per_step={gpus // 8}")
    return load_config(CONFIG_DIR / "swe.yaml", overrides)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-big", action="store_true", help="skip the 4,096-GPU SWE run and the largest scaling point")
    p.add_argument("--skip-search", action="store_true", help="skip the 100-candidate layout search")
    args = p.parse_args()

    print("default config (qwen3-32b, math, 64 x h800), 20 steps")
    print(f"  {'policy':<14} {'wall s':>8} {'events':>9} {'events/s':>9} {'target':>8}")
    for policy in POLICIES:
        wall, events, _ = timed(load_config(), policy)
        print(f"  {policy:<14} {wall:8.2f} {events:9d} {events / wall:9.0f} {'< 2 s':>8}")

    print("steps: default config, tag")
    print(f"  {'steps':>5} {'wall s':>8} {'events':>9} {'wall s per step':>16}")
    for steps in (10, 20, 40):
        wall, events, _ = timed(load_config(overrides=[f"num_steps={steps}"]), "tag")
        print(f"  {steps:5d} {wall:8.2f} {events:9d} {wall / steps:16.3f}")

    if not args.skip_big:
        wall, events, sim_s = timed(swe(4096, 20), "tag")
        print(
            f"swe workload, 4096 x h800, 512 tasks x 8 episodes a step, 20 steps, tag: {wall:.1f} s wall, {events} "
            f"events ({events / wall:.0f}/s), {sim_s / 3600:.1f} simulated hours (target < 60 s)"
        )

    print("weak scaling: swe workload, tag, 8 steps, prompts per step proportional to GPUs")
    print(f"  {'gpus':>5} {'wall s':>8} {'events':>9} {'wall s per 64 GPUs':>19}")
    for gpus in (64, 256, 1024, *(() if args.skip_big else (4096,))):
        wall, events, _ = timed(swe(gpus, 8), "tag")
        print(f"  {gpus:5d} {wall:8.2f} {events:9d} {wall * 64 / gpus:19.2f}")

    if not args.skip_search:
        with tempfile.TemporaryDirectory() as out:
            argv = [
                sys.executable,
                "-m",
                "sim",
                "search",
                "--space",
                "train.tensor_parallel=1,8",
                "--max-candidates",
                "100",
                "--quiet",
                "--no-picture",
                "--out",
                out,
                "--overwrite",
            ]
            start = time.perf_counter()
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            wall = time.perf_counter() - start
        line = next(x for x in done.stdout.splitlines() if " candidates" in x)
        print(f"layout search, default config, 100 candidates: {wall:.1f} s wall ({line.strip()}) (target < 120 s)")


if __name__ == "__main__":
    main()
