"""Tests for expert parallelism (`rollout.expert_parallel`, `train.expert_parallel`): the all-to-all's
bytes against a hand count, its growth with tokens and top-k and its absence at ep = 1, memory per GPU
falling with ep, ZeRO-3 traffic of the experts within their replicas, and the keys' validation."""

from __future__ import annotations

import dataclasses

import pytest

from core import specs
from core.errors import UserError
from core.metrics import summarize
from sim import train_layout as tl
from sim.config import load_config
from sim.cost import GB, CostModel
from sim.runner import simulate

MOE = "qwen3-30b-a3b"  # 48 MoE layers of 128 experts, 8 a token, hidden 2048
BARE = ["train.recompute_logprobs=false", "costs.train_step_overhead_s=0"]


def cost_model(*overrides: str) -> CostModel:
    cfg = load_config(overrides=["cluster.num_gpus=32", f"model={MOE}", *overrides])
    return CostModel(cfg, specs.model(cfg.model), specs.device(cfg.cluster.device))


def test_alltoall_bytes_match_a_hand_count():
    m = specs.model(MOE)
    # 1,000 tokens, 8 experts each, 2,048 bf16 values a hidden state, 7/8 of the experts elsewhere
    assert tl.alltoall_bytes(m, 1000, 8) == pytest.approx(1000 * 8 * 2048 * 2 * 7 / 8)
    assert tl.alltoall_bytes(m, 1000, 1) == 0.0


def test_alltoall_grows_with_tokens_and_top_k():
    m = specs.model(MOE)
    assert tl.alltoall_bytes(m, 2000, 4) == pytest.approx(2 * tl.alltoall_bytes(m, 1000, 4))
    fewer = dataclasses.replace(m, experts_per_token=2)
    assert tl.alltoall_bytes(fewer, 1000, 4) == pytest.approx(tl.alltoall_bytes(m, 1000, 4) / 4)


# ---- rollout ----


def test_an_engine_without_expert_parallelism_pays_no_alltoall():
    cm = cost_model("rollout.tensor_parallel=4")
    assert cm.alltoall_s(256) == 0.0
    assert cm.decode_lines(256, 256 * 1000).overhead == cm.cfg.costs.decode_step_overhead_s


def test_an_engine_alltoall_per_step_matches_a_hand_count():
    cm = cost_model("rollout.tensor_parallel=4", "rollout.expert_parallel=4")
    c, d, m = cm.cfg.costs, cm.device, cm.model
    per_gpu = 256 / 4 * 8 * m.hidden * 2 * 3 / 4  # a quarter of the tokens, 3/4 of their experts elsewhere
    hand = m.moe_layers * 2 * (per_gpu / (d.nvlink_gb_s * GB * c.nvlink_efficiency) + c.alltoall_latency_s)
    assert cm.alltoall_s(256) == pytest.approx(hand)
    assert cm.alltoall_s(512) > cm.alltoall_s(256)


def test_expert_parallel_adds_its_alltoalls_to_decode_and_prefill():
    tp, ep = (
        cost_model("rollout.tensor_parallel=4"),
        cost_model("rollout.tensor_parallel=4", "rollout.expert_parallel=4"),
    )
    for batch, steps in ((1, 1), (64, 10), (256, 100)):
        extra = steps * ep.alltoall_s(batch)
        assert ep.decode_run_s(batch, batch * 1000, steps) == pytest.approx(
            tp.decode_run_s(batch, batch * 1000, steps) + extra
        )
    assert ep.prefill_s(4096, 4096**2 / 2) == pytest.approx(tp.prefill_s(4096, 4096**2 / 2) + ep.alltoall_s(4096))


def test_an_engine_holds_and_receives_the_same_bytes_per_gpu_with_expert_parallelism():
    """Both layouts spread the experts over the engine's GPUs: memory and weight sync are unchanged."""
    tp, ep = (
        cost_model("rollout.tensor_parallel=4"),
        cost_model("rollout.tensor_parallel=4", "rollout.expert_parallel=4"),
    )
    assert ep.kv_capacity_tokens() == tp.kv_capacity_tokens()
    assert ep.sync_s(local=False, targets=4) == tp.sync_s(local=False, targets=4)


# ---- training ----


def test_training_alltoalls_match_a_hand_count():
    """16 train GPUs, dp 16, ep 4 within a node: forward, recomputed forward and backward each dispatch and combine."""
    cm = cost_model(*BARE, "train.expert_parallel=4")
    c, d, m = cm.cfg.costs, cm.device, cm.model
    lens = [4000] * 64
    step = tl.step(cm.cfg, m, d, lens, 16)
    per_replica = sum(lens) / 16
    micro = -(-per_replica // cm.cfg.train.micro_batch_tokens)
    sent = per_replica * 8 * m.hidden * 2 * 3 / 4
    hand = m.moe_layers * 6 * (sent / (d.nvlink_gb_s * GB * c.nvlink_efficiency) + micro * c.alltoall_latency_s)
    assert step.ep_comm_s == pytest.approx(hand)


def test_training_alltoalls_vanish_at_ep_1_and_grow_with_tokens():
    cm1, cm8 = cost_model(*BARE), cost_model(*BARE, "train.expert_parallel=8")
    assert tl.step(cm1.cfg, cm1.model, cm1.device, [4000] * 64, 16).ep_comm_s == 0.0
    short = tl.step(cm8.cfg, cm8.model, cm8.device, [2000] * 64, 16).ep_comm_s
    assert tl.step(cm8.cfg, cm8.model, cm8.device, [4000] * 64, 16).ep_comm_s > 1.9 * short


def test_trainer_memory_per_gpu_falls_with_expert_parallelism():
    """ZeRO-3 gathers one MoE layer at a time: with ep its E/ep experts, not all E."""
    totals, buffers, states = [], [], []
    for ep in (1, 2, 4, 8, 16):
        cm = cost_model(f"train.expert_parallel={ep}")
        mem = tl.memory(cm.cfg, cm.model, cm.device, 16, 8192)
        totals.append(mem.total_gb)
        buffers.append(mem.buffers_gb)
        states.append(mem.state_gb)
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 5
    m = specs.model(MOE)
    routed = m.experts * m.expert_params
    assert buffers[0] - buffers[-1] == pytest.approx(8 * routed * 15 / 16 / GB)  # 2 bf16 + 4 bytes of grads
    assert len(set(states)) == 1  # ZeRO-3 shards the state over every GPU either way


def test_expert_parallelism_keeps_the_experts_zero3_traffic_within_their_replicas():
    """Over the network (32 train GPUs, dp 32 > a node), ep 8 gathers 1/8 of the experts among 4 replicas."""
    cm1, cm8 = (
        cost_model(*BARE, "cluster.num_gpus=64"),
        cost_model(*BARE, "cluster.num_gpus=64", "train.expert_parallel=8"),
    )
    lens = [6000] * 256
    one, eight = (tl.step(cm.cfg, cm.model, cm.device, lens, 32) for cm in (cm1, cm8))
    assert eight.dp_exposed_s < one.dp_exposed_s / 4
    assert eight.train_compute_s == one.train_compute_s


# ---- validation ----


@pytest.mark.parametrize("key", ["rollout.expert_parallel", "train.expert_parallel"])
def test_a_dense_model_refuses_expert_parallelism(key):
    with pytest.raises(UserError, match=rf"^{key}=2 needs a mixture-of-experts model; qwen3-32b is dense"):
        load_config(overrides=[f"{key}=2"])


@pytest.mark.parametrize("key", ["rollout.expert_parallel", "train.expert_parallel"])
def test_expert_parallel_must_divide_the_experts(key):
    with pytest.raises(UserError, match=rf"^{key}=3 must divide the 128 routed experts of {MOE}"):
        load_config(overrides=[f"model={MOE}", f"{key}=3", "rollout.tensor_parallel=1"])


@pytest.mark.parametrize("key", ["rollout.expert_parallel", "train.expert_parallel"])
def test_expert_parallel_must_be_positive(key):
    with pytest.raises(UserError, match=rf"^{key} must be >= 1, got 0"):
        load_config(overrides=[f"model={MOE}", f"{key}=0"])


def test_rollout_expert_parallel_stays_within_an_engine():
    with pytest.raises(UserError, match=r"^rollout.expert_parallel=8 must divide rollout.tensor_parallel=4"):
        load_config(overrides=[f"model={MOE}", "rollout.expert_parallel=8"])


def test_train_expert_parallel_must_divide_data_parallel():
    cm = cost_model("train.expert_parallel=16", "train.tensor_parallel=2")
    with pytest.raises(UserError, match=r"^train.expert_parallel=16 does not divide the data-parallel size 8"):
        cm.check_train_fits(16, 4096)


# ---- whole runs ----


def test_a_run_with_expert_parallelism(small_config):
    base = (f"model={MOE}", "num_steps=2")
    plain = summarize(simulate(small_config(*base), "tag"))
    ep = summarize(simulate(small_config(*base, "rollout.expert_parallel=2", "train.expert_parallel=8"), "tag"))
    assert 0 < ep["token_throughput"] != plain["token_throughput"]
