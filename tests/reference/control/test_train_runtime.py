"""The runtime trains under each policy, end to end: Ray workers, engines, the trajectory manager, the rollout
manager, the trainer shards and `core.driver` (a few small steps each).

What every run must show: it finishes its steps; each trained token's policy-version lag respects the
policy (0 for the strictly on-policy ones, at most `max_staleness` otherwise); every group a step consumed
is marked once in the store and none twice; the stored tokens are exactly what the engines reported; and
the timeline tiles the wall time (the simulator's scorer accepts it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.metrics import summarize
from reference.consistency import check_store
from reference.control.config import load_train_config
from reference.manager.store import TrajectoryStore
from reference.model import load_checkpoint
from reference.trainer.handoff import version_dir

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

SMALL = ["policy.num_steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4", "run.eval_every_steps=0",
         "rollout.max_concurrency=32", "engine.max_batch=32", "run.time_limit_s=300"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """One local Ray for the module, offering the capability tags."""
    ray.init(num_cpus=2, resources={"rollout": 4, "train": 4}, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run(tmp_path: Path, policy: str, *extra: str):
    from reference.control.report import write_outputs
    from reference.train import train

    cfg = load_train_config(None, [*SMALL, f"policy.name={policy}", *extra])
    out = tmp_path / policy
    timeline, metrics = train(cfg, out, progress=False)
    summary = write_outputs(timeline, metrics, {}, out, picture=False)
    return cfg, out, timeline, metrics, summary


@pytest.mark.parametrize("policy, bound", [("colocated", 0), ("disaggregated", 0), ("async", 1), ("tag", 1)])
def test_each_policy_trains_within_its_staleness_bound(tmp_path, policy, bound):
    cfg, out, timeline, metrics, summary = run(tmp_path, policy)
    assert [s["step"] for s in metrics.steps] == [0, 1, 2]
    lags = {int(lag) for lag in summary["staleness"]["histogram"]}
    assert lags, "no trained token was counted"
    assert max(lags) <= bound, f"{policy}: lags {sorted(lags)} exceed {bound}"
    assert summary["token_throughput"] > 0
    assert len(timeline.steps) == 3
    with TrajectoryStore(out / "trajectories.sqlite") as store:
        consumed = store.consumed()
        assert len(consumed) == 3 * cfg.rollout.prompts_per_step  # every step's groups, each once
        assert sorted(set(consumed.values())) == [0, 1, 2]
        model, tok = load_checkpoint(version_dir(out / "weights", 0))
        report = check_store(store, model, tok, version=0)
    assert report.token_mismatches == 0
    assert report.requests > 0
    assert report.max_logprob_diff < 1e-3  # version-0 tokens re-score under the version-0 weights


def test_outputs_match_the_simulators(tmp_path):
    """The same files as `python -m sim`, plus metrics.jsonl and reward.png; the timeline reads back."""
    from core.timeline import Timeline
    from reference.control.report import write_outputs

    cfg, out, timeline, metrics, _ = run(tmp_path, "tag", "policy.num_steps=2")
    write_outputs(timeline, metrics, {"policy": {"name": "tag"}}, out, picture=True)
    for name in ("summary.json", "intervals.json", "timeline.json", "timeline.png", "reward.png", "metrics.jsonl"):
        assert (out / name).is_file(), name
    again = Timeline.load(out / "intervals.json")
    assert summarize(again) == summarize(timeline)
    kinds = [line.split('"kind": "')[1].split('"')[0] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["held_out", "step", "step", "held_out"]
