"""Pieces of the runtime executor that need no running system."""

from __future__ import annotations

import pytest

from reference.control.executor import _shard
from reference.rollout.groups import Episode, GroupResult
from reference.tasks.base import Problem
from reference.trainer.batch import Trajectory
from reference.trainer.handoff import KEEP_LATEST_VERSIONS, prune_versions, version_dir


def test_old_published_versions_are_pruned_but_the_kept_ones_stay(tmp_path):
    for v in range(12):
        version_dir(tmp_path, v).mkdir(parents=True)
    prune_versions(tmp_path, 11, keep=lambda v: v == 0 or v % 5 == 0)
    left = sorted(int(p.name[1:]) for p in tmp_path.iterdir())
    assert left == [0, 5, *range(11 - KEEP_LATEST_VERSIONS + 1, 12)]


def _group(key: str, n: int) -> GroupResult:
    samples = tuple(Episode(key, (f"{key}-r{i}",), 0.5, False, 0, 0, 1) for i in range(n))
    return GroupResult(0, key, Problem("p", "1+1=", "2"), samples)


def _trajectory(key: str) -> Trajectory:
    return Trajectory((1, 2), (0, 1), (-0.5,), (0,), key, 1.0)


def test_whole_groups_go_to_each_data_parallel_shard():
    groups = [_group(f"g{i}", 2) for i in range(3)]
    batch = [_trajectory(g.key) for g in groups for _ in range(2)]
    shards = _shard(groups, batch, 2)
    assert [sorted({t.group_id for t in s}) for s in shards] == [["g0", "g2"], ["g1"]]
    assert sum(len(s) for s in shards) == len(batch)


def test_a_shard_without_a_group_is_refused():
    with pytest.raises(RuntimeError, match="cannot feed 2 data-parallel shards"):
        _shard([_group("g0", 2)], [_trajectory("g0")] * 2, 2)


def test_shards_are_balanced_by_tokens_not_by_group_count():
    """Long-tailed groups: a round robin would give rank 0 the two long groups (g0, g2); by tokens the
    longest goes alone and the three short ones join the other."""
    lengths = {"g0": 200, "g1": 10, "g2": 150, "g3": 20}
    groups = [_group(k, 2) for k in lengths]
    batch = [Trajectory(tuple(range(n)), (0,) + (1,) * (n - 1), (-0.5,) * (n - 1), (0,) * (n - 1), k, 1.0)
             for k, n in lengths.items() for _ in range(2)]  # fmt: skip
    shards = _shard(groups, batch, 2)
    assert [sorted({t.group_id for t in s}) for s in shards] == [["g0"], ["g1", "g2", "g3"]]
    assert [sum(len(t.token_ids) for t in s) for s in shards] == [400, 360]
    assert _shard(groups, batch, 2) == shards  # deterministic
