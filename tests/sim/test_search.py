"""The layout search: candidates, pruning, the Pareto front, outputs, and bad input."""

from __future__ import annotations

import json
import random

import pytest

from core.errors import UserError
from sim import search
from sim.cli import main as sim_main
from sim.config import load_config

FAST = ["--steps", "2", "--quiet", "--no-picture"]


def test_a_policy_is_not_varied_along_keys_it_ignores():
    space = {"pools.train_fraction": [0.25, 0.5], "rollout.tensor_parallel": [2, 4]}
    cands = search.candidates(space, ["colocated", "tag"])
    assert [(c.policy, c.overrides) for c in cands if c.policy == "colocated"] == [
        ("colocated", {"rollout.tensor_parallel": 2}),
        ("colocated", {"rollout.tensor_parallel": 4}),
    ]
    assert sum(c.policy == "tag" for c in cands) == 4
    assert [c.index for c in cands] == list(range(6))


def test_the_space_is_edited_key_by_key():
    space = search.parse_space(["rollout.tensor_parallel=1,8", "rollout.max_num_seqs=", "train.mini_batches=2"])
    assert space["rollout.tensor_parallel"] == [1, 8]
    assert "rollout.max_num_seqs" not in space
    assert space["train.mini_batches"] == [2]
    assert space["pools.train_fraction"] == search.DEFAULT_SPACE["pools.train_fraction"]
    for bad, message in (("tensor_parallel=2", "must look like section.key"), ("rollout.tensor_parallel=2,2", "twice")):
        with pytest.raises(UserError, match=message):
            search.parse_space([bad])


def _fake(index: int, throughput: float, lag: float) -> search.Candidate:
    summary = {"token_throughput": throughput, "staleness": {"mean_lag": lag, "max_lag": 1}}
    return search.Candidate(index, "tag", {}, summary=summary)


def test_the_pareto_front_is_exactly_the_undominated_candidates():
    rng = random.Random(3)
    cands = [_fake(i, rng.choice([10.0, 20.0, 30.0, 40.0]), rng.choice([0.0, 0.5, 0.9])) for i in range(40)]
    cands.append(search.Candidate(40, "tag", {}, pruned="does not fit"))
    front = search.pareto(cands)
    ran = [c for c in cands if c.summary]

    def dominated(c):
        s = c.summary
        return any(
            o.summary["token_throughput"] >= s["token_throughput"]
            and o.summary["staleness"]["mean_lag"] <= s["staleness"]["mean_lag"]
            and (o.summary["token_throughput"], o.summary["staleness"]["mean_lag"])
            != (s["token_throughput"], s["staleness"]["mean_lag"])
            for o in ran
        )

    assert front and all(not dominated(c) for c in front)
    values = {(c.summary["token_throughput"], c.summary["staleness"]["mean_lag"]) for c in front}
    assert all(dominated(c) or (c.summary["token_throughput"], c.summary["staleness"]["mean_lag"]) in values
               for c in ran)  # fmt: skip
    assert len(values) == len(front)  # one candidate per point of the front
    assert [c.summary["token_throughput"] for c in front] == sorted((c.summary["token_throughput"] for c in front),
                                                                    reverse=True)  # fmt: skip


def test_a_search_prunes_what_cannot_run_with_counted_reasons_and_writes_a_rerunnable_best(tmp_path, capsys):
    out = tmp_path / "s"
    argv = [
        "search",
        "--policies",
        "colocated,tag",
        "--space",
        "rollout.tensor_parallel=3,4,8",
        "--space",
        "pools.train_fraction=0.5",
        "--space",
        "rollout.max_num_seqs=",
        "--jobs",
        "1",
        "--out",
        str(out),
        *FAST,
    ]
    assert sim_main(argv) == 0
    printed = capsys.readouterr().out
    assert "6 candidates: 4 ran, 2 pruned" in printed
    assert "pruned   2: cluster.num_gpus=N is not a multiple of rollout.tensor_parallel=N" in printed
    record = json.loads((out / "search.json").read_text())
    assert [(c["policy"], c["overrides"]["rollout.tensor_parallel"], c["pruned"] is None)
            for c in record["candidates"]] == [("colocated", 3, False), ("colocated", 4, True), ("colocated", 8, True),
                                               ("tag", 3, False), ("tag", 4, True), ("tag", 8, True)]  # fmt: skip
    ran = [c for c in record["candidates"] if c["figures"]]
    best = max(ran, key=lambda c: c["figures"]["token_throughput"])
    assert best["pareto"]
    # best.yaml is a config that reproduces the fastest candidate exactly (the simulator is deterministic).
    cfg = load_config(out / "best.yaml")
    assert cfg.rollout.tensor_parallel == best["overrides"]["rollout.tensor_parallel"] and cfg.num_steps == 2
    assert sim_main(["--config", str(out / "best.yaml"), "--policy", best["policy"], "--out", str(tmp_path / "re"),
                     "--quiet", "--no-picture"]) == 0  # fmt: skip
    rerun = json.loads((tmp_path / "re" / "summary.json").read_text())
    assert rerun["token_throughput"] == best["figures"]["token_throughput"]


def test_processes_change_nothing_but_the_time(tmp_path):
    common = ["--policies", "tag,async", "--space", "rollout.max_num_seqs=", "--space", "pools.train_fraction=0.5",
              "--space", "rollout.tensor_parallel=4,8", *FAST]  # fmt: skip
    assert search.main([*common, "--jobs", "1", "--out", str(tmp_path / "one")]) == 0
    assert search.main([*common, "--jobs", "2", "--out", str(tmp_path / "two")]) == 0

    def figures(name):
        record = json.loads((tmp_path / name / "search.json").read_text())
        return [(c["policy"], c["overrides"], c["figures"], c["pareto"]) for c in record["candidates"]]

    assert figures("one") == figures("two")
    assert len(figures("one")) == 4


def test_a_larger_space_is_sampled_with_the_config_seed(tmp_path, capsys):
    argv = [
        "--policies",
        "disaggregated",
        "--space",
        "pools.train_fraction=0.25,0.5,0.75",
        "--space",
        "rollout.max_num_seqs=",
        "--space",
        "rollout.tensor_parallel=4,8",
        "--max-candidates",
        "3",
        "--jobs",
        "1",
    ]
    assert search.main([*argv, "--out", str(tmp_path / "a"), *FAST]) == 0
    assert "3 candidates (sampled from 6)" in capsys.readouterr().out
    assert search.main([*argv, "--out", str(tmp_path / "b"), *FAST]) == 0
    picked = [json.loads((tmp_path / d / "search.json").read_text())["candidates"] for d in "ab"]
    assert [c["overrides"] for c in picked[0]] == [c["overrides"] for c in picked[1]]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--space", "rollout.no_such_key=1,2"], "unknown config key 'rollout.no_such_key'"),
        (["--policies", "tag,fastest"], "unknown policy 'fastest'; valid choices: colocated"),
        (["--jobs", "0"], "--jobs must be >= 1, got 0"),
        (["--space", "tensor_parallel=2"], "must look like section.key=v1,v2"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, tmp_path, capsys):
    assert sim_main(["search", *argv, "--out", str(tmp_path / "x"), *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()
