"""What does the control plane cost per decision? (`core.driver` + a policy, without any real work)

    python -m benchmarks.driver_overhead [--steps 2000] [--batch 16]

Runs each policy for `--steps` training steps on `core.fake.FakeExecutor`'s discrete clock (every decision
completes after a seeded random delay; nothing is computed), and prints the CPU time per dispatched
decision and per training step of the whole loop: event queue, policy, dispatch, contract checks,
timeline recording, plus the fake executor's own bookkeeping (so the figures are an upper bound on the
driver's share). Compare them with a real training step on this machine (about 0.3-1 s for
`make train-math`): the control plane's own overhead must be negligible against it.
"""

from __future__ import annotations

import argparse
import time

from core.cli import at_least
from core.fake import FakeExecutor
from core.policies import POLICIES, PolicyConfig, make_policy


def measure(name: str, steps: int, batch: int) -> dict:
    policy = make_policy(name, PolicyConfig(batch_groups=batch, num_steps=steps, max_staleness=1), 4, 0.5, 1)
    fake = FakeExecutor(policy, seed=0, idle_chance=0.0)
    start = time.process_time()
    fake.run(max_events=50 * steps * batch)
    cpu = time.process_time() - start
    decisions = fake.driver.dispatched
    return {
        "policy": name,
        "steps": policy.step,
        "decisions": decisions,
        "us_per_decision": 1e6 * cpu / decisions,
        "ms_per_step": 1e3 * cpu / max(1, policy.step),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=at_least(1), default=2000)
    ap.add_argument("--batch", type=at_least(1), default=16, help="prompt groups per step")
    args = ap.parse_args()
    print(f"{'policy':>13} | {'steps':>6} | {'decisions':>9} | {'us / decision':>13} | {'ms / step':>9}")
    for name in POLICIES:
        r = measure(name, args.steps, args.batch)
        print(
            f"{r['policy']:>13} | {r['steps']:>6} | {r['decisions']:>9} | {r['us_per_decision']:>13.1f} | "
            f"{r['ms_per_step']:>9.3f}"
        )


if __name__ == "__main__":
    main()
