"""Tests for sim.cost and core.specs: roofline floors, the closed forms against naive sums, memory checks."""

from __future__ import annotations

import random

import pytest

from core import specs
from core.errors import UserError
from core.specs import DeviceSpec, ModelSpec
from core.tags import Tag
from sim.config import load_config
from sim.cost import GB, TFLOP, CostModel


def cost_model(*overrides: str) -> CostModel:
    cfg = load_config(overrides=["cluster.num_gpus=8", *overrides])
    return CostModel(cfg, specs.model(cfg.model), specs.device(cfg.cluster.device))


def naive_decode_run(cm: CostModel, batch: int, sum_ctx: int, steps: int) -> float:
    """Step by step: every step adds one token to each of `batch` contexts."""
    return sum(cm.decode_step_s(batch, sum_ctx + batch * j) for j in range(steps))


def roofline_step(cm: CostModel, batch: int, sum_ctx: int) -> float:
    """One decode step from first principles: read all weights and every running sequence's KV cache,
    or do the matmuls and attention, whichever takes longer, plus the per-step overhead."""
    m, dev, c, tp = cm.model, cm.device, cm.cfg.costs, cm.cfg.rollout.tensor_parallel
    memory = (m.weight_bytes + m.kv_bytes_per_token * sum_ctx) / (tp * dev.hbm_bandwidth_gb_s * GB * c.hbm_efficiency)
    compute = (2 * m.matmul_params * batch + 4 * m.layers * m.attn_dim * sum_ctx) / (
        tp * dev.peak_tflops * TFLOP * c.decode_mfu
    )
    return max(memory, compute) + c.decode_step_overhead_s


# ---- specs ----


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("qwen3-0.6b", 0.596),
        ("qwen3-1.7b", 1.721),
        ("qwen3-4b", 4.022),
        ("qwen3-8b", 8.191),
        ("qwen3-14b", 14.768),
        ("qwen3-32b", 32.762),
    ],
)
def test_parameter_counts_match_the_published_sizes(name, billions):
    m = specs.model(name)
    assert m.params / 1e9 == pytest.approx(billions, abs=1e-3)
    assert m.weight_bytes == 2 * m.params


def test_derived_model_quantities():
    big = specs.model("qwen3-32b")
    assert big.attn_dim == 64 * 128 != big.hidden  # head_dim is read from the config, not hidden / heads
    assert big.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    small = specs.model("qwen3-8b")
    assert small.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2
    assert small.matmul_params == small.params - small.vocab * small.hidden - small.hidden  # no input embedding
    tied = specs.model("qwen3-0.6b")
    assert tied.matmul_params == tied.params - tied.hidden  # the tied embedding is also the output head


def test_unknown_spec_names_list_the_choices():
    with pytest.raises(UserError, match=r"unknown device 'v100'; valid choices: a100, b200, h100, h20, h200, h800"):
        specs.device("v100")
    with pytest.raises(UserError, match=r"unknown model 'qwen2-7b'; valid choices: llama-3.1-405b, llama-3.1-70b"):
        specs.model("qwen2-7b")


# ---- decode ----


@pytest.mark.parametrize("device", ["h800", "h20", "a100"])
@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_a_decode_step_is_never_faster_than_reading_the_weights(device, model, tp):
    dev = specs.device(device)
    # the tightest setting the config allows: perfect HBM efficiency, no per-step overhead
    for extra in ([], ["costs.hbm_efficiency=1.0", "costs.decode_step_overhead_s=0", "costs.decode_mfu=1.0"]):
        cm = cost_model(f"model={model}", f"cluster.device={device}", f"rollout.tensor_parallel={tp}", *extra)
        floor = cm.model.weight_bytes / (tp * dev.hbm_bandwidth_gb_s * GB)
        for batch in (1, 7, 64, 256, 1024):
            for ctx in (0, 1, 512, 8192, 40960):
                assert cm.decode_step_s(batch, batch * ctx) >= floor * (1 - 1e-12), (batch, ctx)


def test_decode_cost_grows_with_batch_and_context():
    cm = cost_model("model=qwen3-8b")
    assert cm.decode_step_s(64, 64 * 1000) > cm.decode_step_s(32, 32 * 1000)
    assert cm.decode_step_s(32, 32 * 2000) > cm.decode_step_s(32, 32 * 1000)
    # but per token a bigger batch is cheaper: the weights are read once per step
    assert cm.decode_step_s(64, 64 * 1000) / 64 < cm.decode_step_s(32, 32 * 1000) / 32


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=qwen3-8b", "rollout.tensor_parallel=1"],  # memory-bound throughout at small batches
        ["model=qwen3-32b", "rollout.tensor_parallel=4"],
        # compute-bound first, then memory wins as contexts grow (q1 > q2)
        ["model=qwen3-8b", "rollout.tensor_parallel=1", "costs.hbm_efficiency=1.0"],
        # memory-bound first, compute overtakes (q2 > q1): attention FLOPs outgrow KV bytes at tiny MFU
        ["model=qwen3-8b", "rollout.tensor_parallel=1", "costs.hbm_efficiency=1.0", "costs.decode_mfu=0.01"],
        ["model=qwen3-0.6b", "cluster.device=a100", "rollout.tensor_parallel=2", "costs.decode_step_overhead_s=0"],
    ],
)
def test_decode_run_closed_form_equals_the_naive_sum(overrides):
    cm = cost_model(*overrides)
    rng = random.Random(7)
    cases = [(1, 0, 1), (1, 100, 5000), (512, 512 * 100, 1000), (3, 10, 0), (2, 0, 3000)]
    cases += [(rng.randint(1, 600), rng.randint(0, 4_000_000), rng.randint(1, 1500)) for _ in range(20)]
    for batch, sum_ctx, steps in cases:
        closed = cm.decode_run_s(batch, sum_ctx, steps)
        assert closed == pytest.approx(naive_decode_run(cm, batch, sum_ctx, steps), rel=1e-9, abs=1e-12)
        # and against a reference that shares no code with the cost model
        first_principles = sum(roofline_step(cm, batch, sum_ctx + batch * j) for j in range(steps))
        assert closed == pytest.approx(first_principles, rel=1e-9, abs=1e-12)


def test_both_decode_regimes_and_a_crossover_are_exercised():
    """Guard for the test above: its configs really cover each ordering of the two lines."""
    hbm1 = ["model=qwen3-8b", "rollout.tensor_parallel=1", "costs.hbm_efficiency=1.0"]
    d = cost_model(*hbm1).decode_lines(512, 512 * 100)
    assert d.p2 > d.p1 and d.q1 > d.q2 and (d.p2 - d.p1) / (d.q1 - d.q2) < 1000  # crosses within the run
    d = cost_model(*hbm1, "costs.decode_mfu=0.01").decode_lines(2, 0)
    assert d.p1 > d.p2 and d.q2 > d.q1


def toy_cost_model() -> CostModel:
    """A made-up model and device on which the memory and compute lines of a decode step are exactly
    parallel: multi-head attention (KV bytes per context token = attention FLOPs per context token)
    on a device whose FLOP/s equal its bytes/s. Which line is on top then depends only on the batch."""
    cfg = load_config(
        overrides=[
            "cluster.num_gpus=8",
            "rollout.tensor_parallel=1",
            "costs.hbm_efficiency=0.5",
            "costs.decode_mfu=0.5",
            "costs.decode_step_overhead_s=0.001",
        ]
    )
    model = ModelSpec(
        name="toy",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=4,
        head_dim=16,
        intermediate=128,
        vocab=1000,
        tie_embeddings=False,
        max_context=4096,
    )
    device = DeviceSpec(
        name="toy",
        description="toy",
        peak_tflops=1.0,
        hbm_gb=80.0,
        hbm_bandwidth_gb_s=1000.0,
        nvlink_gb_s=1.0,
        network_gb_s=1.0,
        pcie_gb_s=1.0,
        gpus_per_node=8,
    )
    return CostModel(cfg, model, device)


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_decode_run_with_parallel_lines(batch):
    cm = toy_cost_model()
    d = cm.decode_lines(batch, 10 * batch)
    assert d.q1 == d.q2  # the case the closed form treats apart
    assert (d.p1 > d.p2) == (batch == 1)  # weights (2 bytes/param) vs matmuls (2 FLOPs/param per sequence)
    for sum_ctx, steps in ((0, 1), (10 * batch, 7), (1000, 300)):
        assert cm.decode_step_s(batch, sum_ctx) == pytest.approx(roofline_step(cm, batch, sum_ctx), rel=1e-12)
        closed = cm.decode_run_s(batch, sum_ctx, steps)
        reference = sum(roofline_step(cm, batch, sum_ctx + batch * j) for j in range(steps))
        assert closed == pytest.approx(reference, rel=1e-12)


def test_decode_steps_within_inverts_decode_run():
    cm = cost_model("model=qwen3-8b", "rollout.tensor_parallel=2")
    rng = random.Random(3)
    for _ in range(200):
        batch, sum_ctx, limit = rng.randint(1, 300), rng.randint(0, 1_000_000), rng.randint(0, 3000)
        budget = rng.uniform(0, 1.2) * cm.decode_run_s(batch, sum_ctx, limit)
        m = cm.decode_steps_within(batch, sum_ctx, budget, limit)
        assert 0 <= m <= limit
        assert cm.decode_run_s(batch, sum_ctx, m) <= budget + 1e-12
        assert m == limit or cm.decode_run_s(batch, sum_ctx, m + 1) > budget
    assert cm.decode_steps_within(8, 800, 0.0, 100) == 0
    assert cm.decode_steps_within(8, 800, 1e9, 100) == 100
    exact = cm.decode_run_s(8, 800, 37)
    assert cm.decode_steps_within(8, 800, exact, 100) == 37  # a budget ending on a step boundary


# ---- prefill and training ----


def test_prefill_is_bounded_below_by_compute_and_by_a_weight_read():
    cm = cost_model("model=qwen3-8b", "rollout.tensor_parallel=2")
    assert cm.prefill_s(0, 0.0) == 0.0
    m, dev, c = cm.model, cm.device, cm.cfg.costs
    weight_read = m.weight_bytes / (2 * dev.hbm_bandwidth_gb_s * GB * c.hbm_efficiency)
    assert cm.prefill_s(1, 0.5) == pytest.approx(weight_read)
    tokens = 20_000
    flops = 2 * m.matmul_params * tokens
    assert cm.prefill_s(tokens, 0.0) == pytest.approx(flops / (2 * dev.peak_tflops * TFLOP * c.prefill_mfu))
    assert cm.prefill_s(tokens, tokens**2 / 2) > cm.prefill_s(tokens, 0.0)  # attention adds work


def test_training_time_scales_inversely_with_gpus():
    """Every term but the fixed overhead is work divided over the train GPUs: the basis for
    balancing disaggregated pools."""
    cm = cost_model("model=qwen3-8b")
    lens = [1500, 300, 4096, 2000] * 64
    overhead = cm.cfg.costs.train_step_overhead_s
    for gpus in (4, 8, 16):
        assert cm.train_step_s(lens, 2 * gpus) - overhead == pytest.approx((cm.train_step_s(lens, gpus) - overhead) / 2)


def test_training_compute_follows_the_six_n_rule_for_short_sequences():
    """With attention negligible and no extra forwards, the compute part is 6 x params x tokens, counting
    the parameters that take part in a matmul (the input embedding is a lookup)."""
    overrides = [
        "model=qwen3-8b",
        "train.recompute_logprobs=false",
        "train.reference_model=false",
        "costs.train_step_overhead_s=0",
    ]
    cm = cost_model(*overrides)
    lens = [64] * 4096
    gpus = 8  # one node: the ZeRO-3 traffic goes over NVLink and hides under the compute
    m, dev, c, t = cm.model, cm.device, cm.cfg.costs, cm.cfg.train
    optimizer = 2 * (2 + t.grad_bytes_per_param + t.optimizer_bytes_per_param) * m.params / gpus
    optimizer_s = optimizer / (dev.hbm_bandwidth_gb_s * GB * c.hbm_efficiency)
    six_n = 6 * m.matmul_params * sum(lens) / (gpus * dev.peak_tflops * TFLOP * c.train_mfu)
    assert cm.train_step_s(lens, gpus) - optimizer_s == pytest.approx(six_n, rel=0.02)
    with_ref = cost_model(*overrides, "train.reference_model=true", "train.recompute_logprobs=true")
    assert with_ref.train_step_s(lens, gpus) > cm.train_step_s(lens, gpus)


def test_train_memory():
    """bf16 weights, fp32 gradients and Adam state sharded over the train GPUs, two unsharded layers of
    weights and one of gradients (ZeRO-3), and activations (here the train.activation_gb override)."""
    cm = cost_model("model=qwen3-32b", "train.activation_gb=12.0")
    per_param = 2 + 4 + 12
    buffers = (2 * 2 + 4) * cm.model.layer_params
    assert cm.train_memory_gb(64) == pytest.approx((per_param * cm.model.params / 64 + buffers) / GB + 12.0)
    # A trainer whose FSDP wraps only the decoder layers keeps the root unit (embeddings, untied lm_head, final
    # norm) gathered for the whole step: its bf16 weights and fp32 gradients on top.
    rooted = cost_model("model=qwen3-32b", "train.activation_gb=12.0", "train.fsdp_root_gathered=true")
    m = cm.model
    root = (2 + 4) * (2 * m.vocab * m.hidden + m.hidden)
    assert rooted.train_memory_gb(64) - cm.train_memory_gb(64) == pytest.approx(root / GB)


# ---- KV cache, sync, switch ----


def test_kv_capacity_against_a_naive_count():
    cm = cost_model("model=qwen3-8b", "rollout.tensor_parallel=2")
    m, r = cm.model, cm.cfg.rollout
    free_per_gpu = 80 * GB * r.gpu_memory_utilization - r.workspace_gb * GB - m.weight_bytes / 2
    assert cm.kv_capacity_tokens() == int(free_per_gpu * 2 // m.kv_bytes_per_token)
    shared = cm.kv_capacity_tokens(train_gpus=16)  # a train-capable engine keeps its bf16 weight shard
    assert shared == int((free_per_gpu - m.weight_bytes / 16) * 2 // m.kv_bytes_per_token)
    assert (
        cost_model(
            "model=qwen3-32b", "rollout.tensor_parallel=1", "cluster.device=a100", "rollout.gpu_memory_utilization=0.5"
        ).kv_capacity_tokens()
        == 0
    )


def test_sync_moves_one_weight_shard_per_gpu():
    zero = [
        "model=qwen3-8b",
        "rollout.tensor_parallel=2",
        "costs.sync_fixed_s=0",
        "costs.broadcast_hop_s=0",
        "costs.nvlink_efficiency=1",
        "costs.network_efficiency=1",
    ]
    cm = cost_model(*zero)
    shard = cm.model.weight_bytes / 2
    assert cm.sync_s(local=True, targets=4) == pytest.approx(shard / (160 * GB))
    assert cm.sync_s(local=False, targets=4) == pytest.approx(shard / (48 * GB))
    hops = cost_model(*zero[:-1], "costs.broadcast_hop_s=0.5", "costs.network_efficiency=1")
    base = hops.sync_s(local=False, targets=1)  # ceil(log2(2)) = 1 hop
    assert hops.sync_s(local=False, targets=3) == pytest.approx(base + 0.5)  # 2 hops
    assert hops.sync_s(local=False, targets=4) == pytest.approx(base + 1.0)  # 3 hops
    default = cost_model("model=qwen3-8b", "rollout.tensor_parallel=2")
    assert default.sync_s(local=True, targets=8) < default.sync_s(local=False, targets=8)


def test_switch_moves_gradient_and_optimizer_shards_either_way():
    cm = cost_model("model=qwen3-8b", "costs.switch_fixed_s=2.0", "costs.pcie_efficiency=0.5")
    moved = (4 + 12) * cm.model.params / 16
    expected = moved / (64 * GB * 0.5) + 2.0
    assert cm.switch_s(Tag.TRAIN, 16) == pytest.approx(expected)
    assert cm.switch_s(Tag.ROLLOUT, 16) == cm.switch_s(Tag.TRAIN, 16)
    assert cm.switch_s(Tag.TRAIN, 32) < cm.switch_s(Tag.TRAIN, 16)


# ---- feasibility ----


def test_check_fits_names_the_inference_constraint_and_the_shortfall():
    cm = cost_model(
        "model=qwen3-32b", "rollout.tensor_parallel=1", "cluster.device=a100", "rollout.gpu_memory_utilization=0.8"
    )
    expected = r"qwen3-32b does not fit for inference: 65.5 GB .* 60.0 GB usable .* by 5.5 GB"
    with pytest.raises(UserError, match=expected):
        cm.check_fits(train_gpus=8, max_request_tokens=1000, colocated=False)


def test_check_fits_names_the_kv_constraint_and_the_shortfall():
    cm = cost_model("model=qwen3-32b", "rollout.tensor_parallel=1", "cluster.device=a100")
    capacity = cm.kv_capacity_tokens()
    with pytest.raises(
        UserError,
        match=rf"holds {capacity} tokens but a request can reach 18432 tokens "
        rf"\(short by {18432 - capacity}\)",
    ):
        cm.check_fits(train_gpus=64, max_request_tokens=18432, colocated=False)
    cm.check_fits(train_gpus=64, max_request_tokens=capacity, colocated=False)  # exactly full is fine


def test_check_fits_names_the_training_constraint_and_the_shortfall():
    cm = cost_model("model=qwen3-32b", "rollout.tensor_parallel=8")
    need = cm.train_memory_gb(8)
    with pytest.raises(
        UserError,
        match=rf"does not fit for training on 8 GPUs: needs {need:.1f} GB per GPU, "
        rf"{need - 80:.1f} GB more than the 80 GB",
    ):
        cm.check_fits(train_gpus=8, max_request_tokens=1000, colocated=True)
    cm.check_fits(train_gpus=16, max_request_tokens=1000, colocated=True)
