"""Does a training step cost more when something ran between it and the step before? The runtime never calls
its trainer back to back: after every step the trainer publishes its weights (it writes every weight out), and
between steps the engines, the trajectory manager and the driver work on the same cores. `make validate`'s
trainer part times each step after a publish (`experiments.runtime_parts.published_steps`); this benchmark
says how much that matters, and how much the others' work would add.

The trainer is `make validate`'s (the throughput workload's model and trainer settings), in this process on one
core with one torch thread; ten batches drawn from the workload. Each batch is timed once under each condition,
every condition preceded by a step on the same batch, the conditions' order reversed on every other batch:
- `after a step`: back to back (the part's old timing);
- `after 1.5 s idle`: the process sleeps;
- `after a publish`: `Trainer.publish` into a folder, the previous version removed (as the runtime does);
- `after others' work`: for 1.5 s a process multiplying matrices on the other core (an engine's kind of work)
  and one serialising JSON on this core in bursts (a driver's), each a fresh interpreter.

It prints, per condition, the total seconds, the ratio of the totals to `after a step` and the median of the
per-batch ratios. One step's time varies by a tenth or more on a shared machine: compare several runs.

    python -m benchmarks.trainer_cold [--batches 10] [--sequences 256]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import run_benchmark

OTHERS = {
    "engine": "import torch, time\n"
    "torch.set_num_threads(1); w = [torch.randn(1024, 1024) for _ in range(10)]; x = torch.randn(64, 1024)\n"
    "end = time.perf_counter() + {secs}\n"
    "while time.perf_counter() < end:\n"
    "    for m in w: x = torch.tanh(x @ m)\n",
    "driver": "import json, time\n"
    "d = [dict(a=i, b=str(i) * 10) for i in range(200)]\n"
    "end = time.perf_counter() + {secs}\n"
    "while time.perf_counter() < end:\n"
    "    t = time.perf_counter()\n"
    "    while time.perf_counter() - t < 0.003: json.loads(json.dumps(d))\n"
    "    time.sleep(0.007)\n",
}


def others_work(secs: float, engine_core: int, driver_core: int) -> None:
    """Run an engine-like process on `engine_core` and a driver-like one on `driver_core` for `secs`."""
    procs = []
    for kind, core in (("engine", engine_core), ("driver", driver_core)):
        code = f"import os; os.sched_setaffinity(0, {{{core}}})\n" + OTHERS[kind].format(secs=secs)
        procs.append(subprocess.Popen([sys.executable, "-c", code]))
    for proc in procs:
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=10, help="batches, each timed once per condition (10)")
    ap.add_argument("--sequences", type=int, default=256, help="sequences a batch (256: one step of the workload)")
    args = ap.parse_args(argv)
    if args.batches < 1 or args.sequences < 1:
        ap.error(f"--batches and --sequences must be at least 1, got {args.batches} and {args.sequences}")

    import torch

    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    own, other = cores[-1], cores[0]
    os.sched_setaffinity(0, {own})
    torch.set_num_threads(1)
    try:
        times = _time_conditions(args, own, other)
    finally:  # a caller in the same process gets its cores and threads back
        os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(threads)
    base = times["after a step"]
    print(f"trainer steps on {args.batches} batches of {args.sequences} sequences, one core ({own}), one thread")
    print(f"{'condition':<22}{'total s':>9}{'ratio':>8}{'median of pairs':>17}")
    for name, values in times.items():
        pairs = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"{name:<22}{sum(values):>9.2f}{sum(values) / sum(base):>8.3f}{pairs:>17.3f}")


def _time_conditions(args, own: int, other: int) -> dict[str, list[float]]:
    """Each batch's step seconds under each condition (see the module's docstring)."""
    from experiments.trainer_parts import workload_batch
    from experiments.validate_setup import runtime_setup
    from reference.model import build_model
    from reference.trainer.config import TrainerConfig
    from reference.trainer.trainer import Trainer

    rt, task, model_config = runtime_setup(10)
    rng = random.Random(0)
    group = rt.rollout.group_size
    batches = [workload_batch(model_config, task, args.sequences, group, rng) for _ in range(args.batches)]
    trainer = Trainer(
        build_model(model_config), TrainerConfig.from_dict(dict(rt.trainer)), pad_id=task.tokenizer.pad_token_id
    )
    trainer.train_step(batches[0])  # warm-up
    with tempfile.TemporaryDirectory() as root:
        conditions = {
            "after a step": lambda: None,
            "after 1.5 s idle": lambda: time.sleep(1.5),
            "after a publish": lambda: trainer.publish(root),
            "after others' work": lambda: others_work(1.5, other, own),
        }
        times: dict[str, list[float]] = {name: [] for name in conditions}
        for i, batch in enumerate(batches):
            order = list(conditions) if i % 2 == 0 else list(reversed(conditions))
            for name in order:
                trainer.train_step(batch)
                conditions[name]()
                start = time.perf_counter()
                trainer.train_step(batch)
                times[name].append(time.perf_counter() - start)
            print(f"batch {i + 1}/{len(batches)}", file=sys.stderr, flush=True)
    return times


if __name__ == "__main__":
    run_benchmark(main)
