"""Weights reach engines on another Ray node without a shared filesystem (`engine.weights_transport: object_store`).

Two Ray nodes on this machine, each with its own temporary directory: node A offers `train`, node B `rollout`, so
the `async` layout puts its trainer (T00) on A and its engine (R00) on B. The run's weights root on the driver's
machine is deleted as soon as the workers have started, so an engine (or a trainer) that read it would fail the
run. The run must still train every step; its engine must end on the final version; every path an engine was
told to load, and the initial weights it started from, must lie under node B's own temporary directory.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from pathlib import Path

import pytest

from reference.control.config import load_train_config

ray = pytest.importorskip("ray")
pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.slow

STEPS = 3
SMALL = [f"policy.num_steps={STEPS}", "policy.name=async", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "run.eval_every_steps=0", "rollout.max_concurrency=32", "engine.max_batch=32", "run.time_limit_s=300",
         "engine.weights_transport=object_store"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster():
    """Node A (the head, where this process connects) offers `train`, node B `rollout`; each its own temp dir
    (short paths: Ray's sockets live under them)."""
    from ray.cluster_utils import Cluster

    dirs = {n: Path(tempfile.mkdtemp(prefix=f"sf{n}-")) for n in "AB"}
    head = {"num_cpus": 1, "resources": {"train": 1}, "temp_dir": str(dirs["A"]), "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args=head)
    c.add_node(num_cpus=1, resources={"rollout": 1}, temp_dir=str(dirs["B"]))
    ray.init(address=c.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        yield c, dirs
    finally:
        ray.shutdown()
        c.shutdown()
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


def test_engines_on_another_node_get_every_version_through_the_object_store(cluster, tmp_path, monkeypatch):
    from reference.control.report import write_outputs
    from reference.control.worker import ResourceWorker
    from reference.engine.client import HTTPEngine
    from reference.ray.workers import RayWorkers
    from reference.train import train

    c, dirs = cluster
    out = tmp_path / "run"
    loads: list[tuple[int, str | None]] = []  # every update_weights an engine was sent (the manager's, a restart's)
    update = HTTPEngine.update_weights

    async def recording(self, version, source=None):
        loads.append((version, source))
        await update(self, version, source)

    monkeypatch.setattr(HTTPEngine, "update_weights", recording)
    started: dict = {}

    def workers_factory(specs, address, **kw):
        """Ray's workers; then the driver's weights root goes, so nothing may read it from here on."""
        started["shipped"] = "initial_weights" in kw
        workers = RayWorkers(specs, address, **kw)
        started["model_dirs"] = {s.name: workers.get(s.name, ResourceWorker.model_dir) for s in specs}
        started["nodes"] = {s.name: workers.get(s.name, ResourceWorker.node_temp_dir) for s in specs}
        shutil.rmtree(out / "weights")
        return workers

    cfg = load_train_config(None, [*SMALL, f"run.ray_address={c.address}"])
    timeline, metrics = train(cfg, out, workers_factory=workers_factory, progress=False)
    summary = write_outputs(timeline, metrics, {}, out, picture=False)

    assert started["shipped"], "the run's own initial weights were not shipped to the workers"
    assert started["nodes"] == {"T00": str(dirs["A"]), "R00": str(dirs["B"])}  # the trainer and the engine apart
    assert Path(started["model_dirs"]["R00"]).is_relative_to(dirs["B"])  # the engine started from its own copy
    assert Path(started["model_dirs"]["T00"]).is_relative_to(dirs["A"])
    assert not (out / "weights").exists()  # nothing was published where the trainer runs
    assert not [*dirs["A"].glob("seamlessflow-weights-*"), *dirs["B"].glob("seamlessflow-weights-*")]  # cleaned up

    assert [s["step"] for s in metrics.steps] == list(range(STEPS))
    assert all(math.isfinite(s["reward_mean"]) and s["samples"] == 16 for s in metrics.steps)
    end = metrics.evaluations[-1]
    assert end["label"] == "end" and end["engine_versions"] == [STEPS], end
    versions = [v for v, _ in loads]
    assert versions and max(versions) == STEPS and versions == sorted(versions)
    assert all(source is not None and Path(source).is_relative_to(dirs["B"]) for _, source in loads), loads
    counters = timeline.counters
    assert counters["syncs"] >= 1 and counters["weights_copy_s_mean"] > 0
    assert summary["token_throughput"] > 0


def test_workers_the_cluster_cannot_hold_are_named_at_once_and_refused_at_the_start_timeout(cluster, caplog):
    """A worker asking for two CPUs (`resources.cores_per_resource: 2`) on nodes of one each: a warning names the
    problem before the wait (an autoscaler may still add such a node), and the start timeout ends in one line
    naming it too, not Ray's GetTimeoutError."""
    from core.errors import UserError
    from reference.control.worker import WorkerSpec
    from reference.ray.workers import RayWorkers

    c, _ = cluster
    spec = WorkerSpec("R00", ("rollout",), (), "unused", num_threads=2)
    problem = "no node of the Ray cluster offers what worker R00 asks for (CPU 2, rollout 1;"
    with caplog.at_level(logging.WARNING, logger="reference.ray.workers"), pytest.raises(UserError) as e:
        RayWorkers([spec], c.address, start_timeout_s=3)
    assert str(e.value).startswith(f"the Ray cluster at {c.address!r} did not start the run's workers within 3 s: ")
    assert problem in str(e.value) and "2 x (CPU 1" not in str(e.value), str(e.value)
    assert str(e.value).endswith("its nodes offer: 1 x (CPU 1, rollout 1); 1 x (CPU 1, train 1)"), str(e.value)
    assert any(problem in r.getMessage() and "waiting up to 3 s" in r.getMessage() for r in caplog.records)
    assert not [a for a in ray.util.list_named_actors() if a.startswith("seamlessflow-R00")]  # nothing left behind
