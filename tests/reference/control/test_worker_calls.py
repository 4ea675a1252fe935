"""Typed worker calls: a resource's handles run the worker's own methods and return its records; a step's line in
metrics.jsonl is built from those records with the keys it always had."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import pytest

from core.timeline import StepRecord
from reference.control.calls import LocalWorkers
from reference.control.executor import step_metrics
from reference.control.worker import Evaluation, ResourceWorker, WeightsCopy, WorkerSpec
from reference.model import default_model, save_checkpoint
from reference.rollout.groups import Episode, GroupResult
from reference.tasks.base import Problem
from reference.trainer.batch import Trajectory
from reference.trainer.handoff import version_dir
from reference.trainer.trainer import StepMetrics

# metrics.jsonl's keys of a step (tests/reference/control/test_train_runtime.py reads them from real runs)
STEP_KEYS = set(
    """step reward_mean reward_std exact_match samples trained_tokens generated_tokens staleness loss kl entropy
    clip_fraction grad_norm train_s publish_s step_s time_s tokens_per_s_trained episodes pg_loss dual_clip_fraction
    ratio_mean ratio_max off_policy_fraction is_weight_mean is_weight_max is_capped_fraction fresh_tokens
    fresh_mismatch_mean fresh_kl dropped_groups dropped_sequences""".split()
)


def _batch(seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for group in range(2):
        prompt = [rng.randrange(5, 200) for _ in range(4)]
        for _ in range(4):
            answer = [rng.randrange(5, 200) for _ in range(4)]
            out.append(Trajectory(prompt + answer, [0] * 4 + [1] * 4, [-1.0] * 4, [0] * 4, group, rng.random()))
    return out


@pytest.fixture(scope="module")
def trainer_worker(tmp_path_factory):
    """A train-only resource's worker with its trainer shard (built once: the tests only add steps to it)."""
    tmp_path = tmp_path_factory.mktemp("worker")
    model, tok = default_model(seed=3)
    initial = save_checkpoint(model, tok, tmp_path / "initial")
    worker = ResourceWorker(WorkerSpec("T00", ("train",), (), str(initial)))
    worker.init_trainer(0, 1, "", {"kl_coef": 0.0}, str(tmp_path / "checkpoints"), None)
    yield worker, str(initial)
    worker.close()


def test_a_trainers_handle_returns_its_workers_records(trainer_worker, tmp_path):
    worker, initial = trainer_worker
    workers = LocalWorkers({"T00": worker})
    root = tmp_path / "weights"

    async def calls():
        trainer = workers.trainer("T00")
        metrics = await trainer.train_step(_batch(0))
        published = await trainer.publish(str(root))
        said, payload = trainer.publish_payload("float32")
        return metrics, published, await said, payload, await workers.rollout("T00").model_dir()

    metrics, published, said, payload, model_dir = asyncio.run(calls())
    assert isinstance(metrics, StepMetrics)
    assert metrics.step == worker.trainer.step  # the version this step produced
    version = metrics.step
    assert published == WeightsCopy(version, str(version_dir(root, version)), published.seconds, published.bytes)
    assert published.bytes > 0
    assert said.version == payload.version == version
    assert said.path is None  # left where it was made, written nowhere
    assert model_dir == initial


def test_a_worker_without_an_engine_says_it_holds_no_engine_dtype(trainer_worker):
    worker, _ = trainer_worker
    assert asyncio.run(LocalWorkers({"T00": worker}).rollout("T00").weights_dtype()) is None


def test_a_blocking_call_is_the_same_method(trainer_worker):
    worker, initial = trainer_worker
    assert LocalWorkers({"T00": worker}).get("T00", ResourceWorker.model_dir) == initial


def _metrics(tokens: int, loss: float, time_s: float) -> StepMetrics:
    names = [f.name for f in dataclasses.fields(StepMetrics)]
    values = dict.fromkeys(names, 0.0) | {"step": 4, "tokens": tokens, "loss": loss, "time_s": time_s}
    return StepMetrics(**values)


def test_a_steps_metrics_line_keeps_its_keys_and_weighs_the_shards_by_tokens():
    episodes = tuple(Episode("s", ("r",), float(i % 2), i == 1, 2, 3, 4) for i in range(4))
    groups = [GroupResult(0, "g0", Problem("p", "1+1=", "2"), episodes)]
    results = [_metrics(30, 1.0, 2.0), _metrics(10, 3.0, 4.0)]
    record = StepRecord(3, 10.0, 16.0, 100, 40, {0: 30, 1: 10}, 4)
    line = step_metrics(3, groups, results, WeightsCopy(4, "/w/v4", 0.5, 123), record)
    assert line.keys() == STEP_KEYS
    assert line["loss"] == pytest.approx((30 * 1.0 + 10 * 3.0) / 40)
    assert line["train_s"] == 4.0  # the slowest rank
    assert line["publish_s"] == 0.5
    assert line["staleness"] == {"0": 30, "1": 10}
    assert math.isclose(line["tokens_per_s_trained"], 30 / 4.0)
    assert line["exact_match"] == 0.25


def test_an_evaluation_goes_to_metrics_under_its_own_names():
    assert Evaluation(reward_mean=0.5, exact_match=0.25, eval_s=1.5).to_metrics() == {
        "reward_mean": 0.5,
        "exact_match": 0.25,
        "eval_s": 1.5,
    }
