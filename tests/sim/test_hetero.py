"""Heterogeneous clusters: train-capable GPUs of one device type, rollout-only GPUs of another
(`cluster.rollout_pool`), each engine at its own device's speed, syncs across them, prices and cost."""

from __future__ import annotations

import json
import math
import random

import pytest
import yaml

from core import specs
from core.errors import UserError
from core.metrics import check_conservation, summarize
from core.policies.base import split_pools
from core.tags import Phase
from sim import search
from sim.cli import main as sim_main
from sim.config import load_config
from sim.cost import GB, CostModel
from sim.runner import Simulation, simulate

SMALL = ["num_steps=3", "workload.prompts_per_step=16", "model=qwen3-8b", "rollout.tensor_parallel=2"]
# 16 H800 that train (8 resources) and 16 H20 that only roll out (8 resources).
MIXED = [
    *SMALL,
    "cluster.num_gpus=16",
    "cluster.rollout_pool.device=h20",
    "cluster.rollout_pool.num_gpus=16",
    "cluster.rollout_pool.price_per_gpu_hour=null",
    "cluster.rollout_pool.max_num_seqs=null",
]
POOLED = ["disaggregated", "async", "tag", "streaming"]


def mixed(*overrides: str):
    return load_config(overrides=[*MIXED, *overrides])


def device_file(tmp_path, name: str, **fields) -> str:
    """A device YAML file: the H20's figures with `fields` changed."""
    values = {k: v for k, v in vars(specs.device("h20")).items() if k not in ("name", "description")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**values, **fields}))
    return str(path)


# ---- layout and per-device engines ----


def test_split_pools_gives_back_the_pool_sizes_of_a_mixed_cluster():
    for total in range(2, 130):
        for n_train in range(1, total):
            rollout, train = split_pools(total, n_train / total, devices=4)
            assert (len(rollout), len(train)) == (total - n_train, n_train), (total, n_train)


def test_rollout_only_engines_run_on_the_rollout_device_and_train_capable_ones_on_the_train_device():
    sim = Simulation.from_config(mixed(), "tag")
    rollout_only, trainers = set(sim.policy.rollout_only), set(sim.policy.trainers)
    assert len(rollout_only) == 8 and len(trainers) == 8 and sim.train_gpus == 16
    for name, engine in sim.engines.items():
        assert engine.cost.device.name == ("h20" if name in rollout_only else "h800"), name
    h20 = CostModel(sim.cfg, specs.model("qwen3-8b"), specs.device("h20"))
    h800 = CostModel(sim.cfg, specs.model("qwen3-8b"), specs.device("h800"))
    blocks = sim.cfg.rollout.kv_block_tokens
    for name in rollout_only:  # the H20's 96 GB, no trainer's shard beside the weights
        assert sim.engines[name].kv_blocks.capacity == -(-h20.kv_capacity_tokens() // blocks)
    for name in trainers:  # the H800's 80 GB beside the trainer's resident weight shard
        assert sim.engines[name].kv_blocks.capacity == -(-h800.kv_capacity_tokens(16) // blocks)


def test_an_h20_engine_decodes_a_full_batch_slower_and_a_single_sequence_faster_than_an_h800():
    sim = Simulation.from_config(mixed(), "tag")
    h20, h800 = sim.engines[sim.policy.rollout_only[0]].cost, sim.engines[sim.policy.trainers[0]].cost
    # A full batch is compute-bound on the H20: it has 148 bf16 TFLOPS to the H800's 989.
    assert h20.decode_run_s(256, 256 * 3000, 100) > h800.decode_run_s(256, 256 * 3000, 100)
    # One sequence is memory-bound: the H20's HBM is faster (4.0 TB/s to 3.35).
    assert h20.decode_run_s(1, 3000, 100) < h800.decode_run_s(1, 3000, 100)
    assert h20.prefill_s(8192, 8192 * 4096) > 5 * h800.prefill_s(8192, 8192 * 4096)


def test_the_rollout_pool_can_run_fewer_requests_an_engine():
    sim = Simulation.from_config(mixed("cluster.rollout_pool.max_num_seqs=32"), "tag")
    seqs = {name: engine.max_seqs for name, engine in sim.engines.items()}
    assert seqs == {name: 32 if name in sim.policy.rollout_only else 256 for name in sim.engines}
    default = Simulation.from_config(mixed(), "tag")
    assert {e.max_seqs for e in default.engines.values()} == {256}  # null: rollout.max_num_seqs


def test_rollout_only_engines_generate_at_their_devices_speed(tmp_path):
    """A rollout device with half the H800's compute and memory bandwidth generates at about half its rate."""
    h800 = {k: v for k, v in vars(specs.device("h800")).items() if k not in ("name", "description")}
    half = device_file(tmp_path, "half", **{**h800, "peak_tflops": 494.5, "hbm_bandwidth_gb_s": 1675.0})

    def rate(cfg):
        sim = Simulation.from_config(cfg, "async")
        ivs = [iv for iv in sim.run().intervals if iv.phase is Phase.ROLLOUT and iv.resource in sim.policy.rollout_only]
        return sum(iv.tokens for iv in ivs) / math.fsum((iv.end_s - iv.start_s) * iv.devices for iv in ivs)

    ratio = rate(mixed(f"cluster.rollout_pool.device={half}")) / rate(mixed("cluster.rollout_pool.device=h800"))
    assert 0.45 < ratio < 0.75  # above a half: the per-step overhead is not halved, and batches grow


def test_a_rollout_pool_of_the_train_device_is_the_uniform_cluster():
    same = simulate(mixed("cluster.rollout_pool.device=h800"), "tag")
    uniform = simulate(load_config(overrides=[*SMALL, "cluster.num_gpus=32", "pools.train_fraction=0.5"]), "tag")
    assert same.intervals == uniform.intervals and same.steps == uniform.steps
    assert same.meta["device"] == "h800+h800" and same.meta["num_gpus"] == 32
    assert same.meta["pools"] == {"train": {"device": "h800", "num_gpus": 16},
                                  "rollout": {"device": "h800", "num_gpus": 16}}  # fmt: skip


def test_a_uniform_config_is_described_as_before():
    cfg = load_config(overrides=[*SMALL, "cluster.num_gpus=32"])
    sim = Simulation.from_config(cfg, "tag")
    assert sim.rollout_cost is sim.cost and all(cost is sim.cost for cost in sim.cost_of.values())
    assert cfg.train_fraction == cfg.pools.train_fraction and cfg.cluster_label == "32 x h800"
    meta = sim.run().meta
    assert meta == {"policy": "tag", "model": "qwen3-8b", "device": "h800", "num_gpus": 32, "workload": "math",
                    "seed": 0, "clock": "simulated"}  # fmt: skip


@pytest.mark.parametrize("policy", POOLED)
def test_device_seconds_are_conserved_on_a_mixed_cluster(policy):
    timeline = simulate(mixed(), policy)
    check_conservation(timeline)
    devices = {iv.resource: iv.devices for iv in timeline.intervals}
    assert len(devices) == 16 and sum(devices.values()) == 32
    summary = summarize(timeline)
    assert summary["device_seconds"]["total"] == pytest.approx(32 * timeline.wall_s, rel=1e-9)
    assert summary["num_steps"] == 3 and summary["token_throughput"] > 0


# ---- weight sync across device types ----


def test_a_sync_crosses_at_the_slower_nic_of_sender_and_receiver(tmp_path):
    cfg = mixed()
    h800 = CostModel(cfg, specs.model("qwen3-8b"), specs.device("h800"))
    slow, fast = specs.device(device_file(tmp_path, "slow", network_gb_s=6.0)), specs.device("h200")
    c = cfg.costs
    shard = specs.model("qwen3-8b").weight_bytes / 2
    fixed = 3 * c.broadcast_hop_s + c.sync_fixed_s  # ceil(log2(4 + 1)) hops
    assert h800.sync_s(False, 4, slow) == pytest.approx(shard / (6 * GB * c.network_efficiency) + fixed)
    assert h800.sync_s(False, 4, fast) == h800.sync_s(False, 4) == h800.sync_s(False, 4, specs.device("h800"))
    assert h800.sync_s(True, 4, slow) == h800.sync_s(True, 4)  # a local reshard never leaves the node


def test_syncs_to_rollout_only_resources_on_a_slow_network_take_its_time(tmp_path):
    slow = device_file(tmp_path, "slow", network_gb_s=6.0)
    sim = Simulation.from_config(mixed(f"cluster.rollout_pool.device={slow}"), "disaggregated")
    timeline = sim.run()
    expected = sim.cost.sync_s(False, 8, specs.device(slow))
    assert expected > 2 * sim.cost.sync_s(False, 8)
    syncs = [iv for iv in timeline.intervals if iv.phase is Phase.SYNC]
    assert syncs and {iv.resource for iv in syncs} == set(sim.policy.rollout_only)
    for iv in syncs:
        assert iv.end_s - iv.start_s == pytest.approx(expected, rel=1e-9), iv


# ---- refusals ----


def test_colocated_refuses_a_mixed_cluster_in_one_line(capsys):
    refusal = r"policy 'colocated' trains on every resource, but the 16 GPUs of cluster\.rollout_pool only generate"
    with pytest.raises(UserError, match=refusal):
        Simulation.from_config(mixed(), "colocated")
    argv = ["--policy", "colocated", "--quiet", "--no-picture", *(a for o in MIXED for a in ("--set", o))]
    assert sim_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cluster.rollout_pool" in err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.rollout_pool.num_gpus=3"], "cluster.rollout_pool.num_gpus=3 is not a multiple of "
                                              "rollout.tensor_parallel=2"),
        (["cluster.rollout_pool.num_gpus=0"], "cluster.rollout_pool.num_gpus must be >= 1, got 0"),
        (["cluster.rollout_pool.device=tpu-v5"], "cluster.rollout_pool.device: unknown device 'tpu-v5'"),
        (["cluster.rollout_pool.gpus=4"], "unknown config key 'cluster.rollout_pool.gpus'"),
        (["cluster.rollout_pool.price_per_gpu_hour=-1"], "cluster.rollout_pool.price_per_gpu_hour must be >= 0"),
        (["cluster.price_per_gpu_hour=2.0"], "cluster.price_per_gpu_hour and cluster.rollout_pool.price_per_gpu_hour "
                                             "must both be set or both be null"),
        (["cluster.rollout_pool.num_gpus=yes"], "config key 'cluster.rollout_pool.num_gpus' must be an integer"),
        (["cluster.rollout_pool.max_num_seqs=0"], "cluster.rollout_pool.max_num_seqs must be null or in [1, "),
    ],
)  # fmt: skip
def test_a_bad_pool_field_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(UserError) as info:
        mixed(*overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_missing_pool_key_is_named():
    with pytest.raises(UserError, match=r"missing config key 'cluster\.rollout_pool\.price_per_gpu_hour'"):
        load_config(overrides=[*MIXED[:-2], "cluster.rollout_pool.max_num_seqs=64"])


def test_a_rollout_device_whose_node_the_engine_does_not_divide_is_named(tmp_path):
    odd = device_file(tmp_path, "odd", gpus_per_node=3)
    with pytest.raises(UserError, match=r"divide the 3 GPUs of a node \(cluster\.rollout_pool\.device\)"):
        mixed(f"cluster.rollout_pool.device={odd}")


@pytest.mark.parametrize(
    ("hbm_gb", "message"),
    [(12.0, "does not fit for inference: .* usable on one tiny"), (14.0, "KV cache of one engine on tiny holds")],
)
def test_memory_checks_run_per_device_and_name_the_device_that_fails(tmp_path, hbm_gb, message):
    tiny = device_file(tmp_path, "tiny", hbm_gb=hbm_gb)
    with pytest.raises(UserError, match=message):
        Simulation.from_config(mixed(f"cluster.rollout_pool.device={tiny}"), "tag")


def test_a_train_device_without_engines_is_only_checked_for_training(tmp_path):
    """disaggregated runs no engine on the train pool: a device too small to hold an engine's KV cache
    (but big enough for the trainer's shard of 16 GPUs) trains; tag, which rolls out on it, refuses."""
    small = device_file(tmp_path, "small", hbm_gb=14.0)
    train_on_small = [f"cluster.device={small}", "cluster.rollout_pool.device=h800", "train.activation_gb=1.0"]
    sim = Simulation.from_config(mixed(*train_on_small), "disaggregated")
    assert {e.cost.device.name for e in sim.engines.values()} == {"h800"}
    with pytest.raises(UserError, match="KV cache of one engine on small holds"):
        Simulation.from_config(mixed(*train_on_small), "tag")


# ---- prices and cost ----


def test_cost_per_million_tokens_comes_from_the_prices_and_the_wall_time():
    cfg = mixed("cluster.price_per_gpu_hour=2.0", "cluster.rollout_pool.price_per_gpu_hour=1.0")
    assert cfg.price_per_hour == 16 * 2.0 + 16 * 1.0
    timeline = simulate(cfg, "tag")
    summary = summarize(timeline)
    tokens = sum(s.tokens for s in timeline.steps)
    assert timeline.meta["price_per_hour"] == 48.0
    assert summary["cost_per_million_tokens"] == pytest.approx(48.0 * timeline.wall_s / 3600 / (tokens / 1e6))
    assert summary["cost_per_million_tokens"] == pytest.approx(48.0 / 3600 / summary["token_throughput"] * 1e6)
    uniform = load_config(overrides=[*SMALL, "cluster.num_gpus=32", "cluster.price_per_gpu_hour=2.0"])
    assert uniform.price_per_hour == 64.0 and "cost_per_million_tokens" in summarize(simulate(uniform, "tag"))
    assert "cost_per_million_tokens" not in summarize(simulate(mixed(), "tag"))  # unpriced: no cost figure


# ---- the layout search ----


def _fake(index: int, throughput: float, lag: float, cost: float) -> search.Candidate:
    summary = {"token_throughput": throughput, "staleness": {"mean_lag": lag}, "cost_per_million_tokens": cost}
    return search.Candidate(index, "tag", {}, summary=summary)


def test_a_priced_pareto_front_is_exactly_the_candidates_no_other_beats_on_all_three():
    rng = random.Random(5)
    cands = [_fake(i, rng.choice([10.0, 20, 30]), rng.choice([0.0, 0.5, 0.9]), rng.choice([1.0, 2, 3]))
             for i in range(60)]  # fmt: skip

    def key(c):
        s = c.summary
        return (-s["token_throughput"], s["staleness"]["mean_lag"], s["cost_per_million_tokens"])

    def dominated(c):
        return any(all(a <= b for a, b in zip(key(o), key(c), strict=True)) and key(o) != key(c) for o in cands)

    front = search.pareto(cands)
    assert all(not dominated(c) for c in front)
    assert {key(c) for c in front} == {key(c) for c in cands if not dominated(c)}
    assert len(front) == len({key(c) for c in front})  # one candidate per point


def test_the_search_varies_the_rollout_pool_and_shows_the_cost(tmp_path, capsys):
    sets = [*MIXED, "cluster.price_per_gpu_hour=2.0", "cluster.rollout_pool.price_per_gpu_hour=1.0", "num_steps=2"]
    argv = ["--policies", "tag,colocated", "--space", "cluster.rollout_pool.num_gpus=8,16", "--space",
            "rollout.tensor_parallel=", "--space", "rollout.max_num_seqs=", "--jobs", "1", "--quiet", "--no-picture",
            "--out", str(tmp_path / "s"), *(a for o in sets for a in ("--set", o))]  # fmt: skip
    assert search.main(argv) == 0
    printed = capsys.readouterr().out
    assert "4 candidates: 2 ran, 2 pruned" in printed  # pools.train_fraction is not varied: the devices split
    assert "pruned   2: policy 'colocated' trains on every resource" in printed
    assert "16 x h800 + 16 x h20" in printed and "cost/Mtok" in printed
    record = json.loads((tmp_path / "s" / "search.json").read_text())
    ran = [c for c in record["candidates"] if c["figures"]]
    assert [c["overrides"]["cluster.rollout_pool.num_gpus"] for c in ran] == [8, 16]
    assert all(c["figures"]["cost_per_million_tokens"] > 0 for c in ran)
    best = load_config(tmp_path / "s" / "best.yaml")
    assert best.cluster.rollout_pool is not None and best.cluster.rollout_pool.device == "h20"


def test_a_mixed_run_writes_its_cluster_into_the_outputs(tmp_path):
    from sim.report import table, write_run

    cfg = mixed("cluster.price_per_gpu_hour=2.0", "cluster.rollout_pool.price_per_gpu_hour=1.0")
    summary = write_run(simulate(cfg, "tag"), cfg, tmp_path, picture=False)
    assert "cost per million trained tokens" in table([summary])
    assert load_config(tmp_path / "config.yaml").cluster == cfg.cluster
    meta = json.loads((tmp_path / "intervals.json").read_text())["meta"]
    assert (meta["device"], meta["num_gpus"], meta["price_per_hour"]) == ("h800+h20", 32, 48.0)


def test_the_experiment_writes_costs_for_every_cluster_and_policy(tmp_path):
    from experiments import heterogeneous

    assert heterogeneous.main(["--steps", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "heterogeneous.json").read_text())
    assert record["clusters"] == {"mixed": "32 h800 + 32 h20", "same GPU count": "64 h800", "same cost": "52 h800"}
    assert len(record["runs"]) == (12 + 3 + 3) * 3  # concurrency settings x policies
    for by_policy in record["best"].values():
        assert set(by_policy) == {"tag", "async", "streaming"}
        assert all(run["summary"]["cost_per_million_tokens"] > 0 for run in by_policy.values())
    assert (tmp_path / "heterogeneous.png").stat().st_size > 0


def test_compare_on_a_mixed_cluster_leaves_colocated_out_and_compares_with_disaggregated(tmp_path, capsys):
    from sim.cli import main

    argv = ["--compare", "--config", "sim/configs/hetero.yaml", "--set", "num_steps=2", "--no-picture", "--quiet",
            "--out", str(tmp_path / "cmp")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "relative to disaggregated:" in out and "colocated" not in out.split("relative to")[1]
    assert "32 x h800 + 32 x h20" in out.splitlines()[0]
    assert not (tmp_path / "cmp" / "colocated").exists()
