"""How long does one version of the weights take to reach an engine's node? The `directory` transport against
`object_store` (`engine.weights_transport`, `reference/control/transport.py`), per version, on two Ray nodes.

Two Ray nodes on this machine (`ray.cluster_utils.Cluster`), each with its own temporary directory: node A
offers `train` and runs a trainer shard (a `ResourceWorker` actor), node B offers `rollout` and runs a worker that
owns no engine process (the engine's load is the same for both: a local version directory). Per version:

- `directory`: `DirectoryTransport.publish`, what a training step waits for: rank 0 writes the version directory
  (the model's fp32 weights, fsynced) under a root on this machine, which every engine then reads; across real
  nodes that read goes through the shared filesystem, not timed here.
- `object_store`: `ObjectStoreTransport.publish`, what a step waits for (rank 0 gathers and casts the engine's
  tensors, Ray stores them in node A's object store), then until node B's copy is written (`sources`: Ray
  moves the bytes to node B, its worker writes them fsynced): what a sync waits for, in the engines' dtype:
  float32 for the built-in engine, bfloat16 for vLLM's.

A new version between timings is a trainer step whose samples are all masked (the version moves on, the weights
do not: no gradient work). Models: `math` (the math recipe's, 0.4 M parameters), `tiny` (the runtime's default
tiny Qwen3, 4 M), `100m` (a random Qwen3 of about 100 M parameters built from a config: 12 layers, 768 wide,
32,000-token vocabulary; nothing is downloaded).

    python -m benchmarks.weight_handoff [--models math,tiny,100m] [--versions 5]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from benchmarks.harness import run_benchmark
from core.cli import at_least
from reference.control.transport import DirectoryTransport, ObjectStoreTransport
from reference.control.worker import ResourceWorker, WorkerSpec
from reference.model import build_model, tiny_config
from reference.ray.workers import ActorWorkers, _RayResourceWorker
from reference.tasks.tokenizer import task_tokenizer
from reference.tokenizer import default_tokenizer
from reference.trainer.batch import Trajectory
from reference.trainer.handoff import publish_weights
from reference.trainer.recipe import MathRecipe

GB = 2**30


def model_configs() -> dict:
    return {
        "math": (MathRecipe().model_config(task_tokenizer().vocab_size), task_tokenizer()),
        "tiny": (tiny_config(4096), default_tokenizer()),
        "100m": (
            tiny_config(
                32000,
                hidden_size=768,
                num_hidden_layers=12,
                num_attention_heads=12,
                num_key_value_heads=4,
                head_dim=64,
                intermediate_size=2048,
                max_position_embeddings=2048,
            ),
            default_tokenizer(),
        ),
    }


def _masked_step(version: int) -> list[Trajectory]:
    """A step that only moves the trainer's version on (every sample masked out of the loss)."""
    return [Trajectory((1, 2), (0, 1), (-0.5,), (version,), "g", float(i), trained=False) for i in range(2)]


async def _time(workers: ActorWorkers, transport, versions: int, split: bool) -> list[tuple[float, float, float]]:
    """(seconds until publish returns, until node B's copy is ready, of which node B's worker wrote) per version."""
    out = []
    for i in range(versions):
        await workers.trainer("T00").train_step(_masked_step(i))
        start = time.perf_counter()
        await transport.publish(["T00"], i + 1)
        published = time.perf_counter() - start
        if split:
            await transport.sources(i + 1, ["R00"])
        written = transport.stage_s[-1] if transport.stage_s else 0.0
        out.append((published, time.perf_counter() - start, written))
    await transport.close()
    return out


def measure(name: str, config, tokenizer, versions: int, work: Path) -> list[tuple]:
    model = build_model(config, seed=0)
    params = sum(p.numel() for p in model.parameters())
    initial = publish_weights(model.state_dict(), config, work / "initial", 0, tokenizer).path
    del model
    actor = ray.remote(_RayResourceWorker)
    rows = []
    for transport_name, dtype in (("directory", "float32"), ("object_store", "float32"), ("object_store", "bfloat16")):
        specs = WorkerSpec("T00", ("train",), (), str(initial)), WorkerSpec("R00", (), (), str(initial))
        trainer = actor.options(num_cpus=1, resources={"train": 1}).remote(specs[0])
        receiver = actor.options(num_cpus=1, resources={"rollout": 1}).remote(specs[1])
        workers = ActorWorkers({"T00": trainer, "R00": receiver})
        try:
            workers.get("T00", ResourceWorker.init_trainer, 0, 1, "", {}, None, None)
            if transport_name == "directory":
                root = work / f"weights-{name}"
                transport = DirectoryTransport(workers, root, lambda v: v == 0)
            else:
                transport = ObjectStoreTransport(workers, ["R00"], dtype, {"R00": str(initial)}, lambda e: 0)
            times = asyncio.run(_time(workers, transport, versions, transport_name == "object_store"))
        finally:
            for a in (trainer, receiver):
                ray.get(a.close.remote())
                ray.kill(a)
        publish, ready, written = (statistics.median(column) for column in zip(*times, strict=True))
        rows.append((name, f"{params / 1e6:.1f} M", transport_name, dtype, publish, ready, written))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="math,tiny,100m", help="comma-separated: math, tiny, 100m")
    p.add_argument("--versions", type=at_least(1), default=5, help="versions timed per transport (median reported)")
    args = p.parse_args()
    configs = model_configs()
    names = [n for n in args.models.split(",") if n]
    if unknown := [n for n in names if n not in configs]:
        raise SystemExit(f"unknown model {unknown[0]!r}; choose from {', '.join(configs)}")
    dirs = {n: Path(tempfile.mkdtemp(prefix=f"sfbench{n}-")) for n in "AB"}
    store = 2 * GB
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"train": 1},
            "temp_dir": str(dirs["A"]),
            "include_dashboard": False,
            "object_store_memory": store,
        },
    )
    cluster.add_node(num_cpus=1, resources={"rollout": 1}, temp_dir=str(dirs["B"]), object_store_memory=store)
    ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
    work = Path(tempfile.mkdtemp(prefix="sf-handoff-bench-"))
    try:
        print(f"two Ray nodes on this machine; {args.versions} versions per row, medians")
        header = ("model", "params", "transport", "dtype", "publish", "on B's node", "B's write")
        widths = (6, 8, 13, 9, 10, 12, 10)
        print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
        for name in names:
            config, tokenizer = configs[name]
            for row in measure(name, config, tokenizer, args.versions, work):
                *text, publish, ready, written = row
                cells = (
                    *text,
                    *(f"{t * 1e3:.0f} ms" for t in (publish, ready)),
                    f"{written * 1e3:.0f} ms" if written else "-",
                )
                print(" ".join(f"{v:>{w}}" for v, w in zip(cells, widths, strict=True)), flush=True)
        print(
            "publish: what a training step waits for; on B's node: until the engine's node has the version "
            "(directory: the same, where node B shares this filesystem); B's write: of that, node B's worker "
            "writing its copy (the rest is Ray moving the bytes)"
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    run_benchmark(main)
