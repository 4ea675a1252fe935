"""Tests for sim.train_layout: the 1F1B bubble against a naive schedule, epochs and mini-batches, the
parallel layout's traffic against hand counts, the memory check's messages, and the old default."""

from __future__ import annotations

import pytest

from core import specs
from core.errors import UserError
from sim import train_layout as tl
from sim.config import RECOMPUTE, load_config
from sim.cost import GB, TFLOP, CostModel
from sim.workload import Workload

# Short sequences, no forward-only passes and no fixed overhead: the step is the training passes alone.
BARE = ["train.recompute_logprobs=false", "costs.train_step_overhead_s=0"]


def cost_model(*overrides: str) -> CostModel:
    cfg = load_config(overrides=list(overrides))
    return CostModel(cfg, specs.model(cfg.model), specs.device(cfg.cluster.device))


def step(cm: CostModel, lens: list[int], gpus: int) -> tl.TrainStep:
    return tl.step(cm.cfg, cm.model, cm.device, lens, gpus)


def default_batch(cm: CostModel) -> list[int]:
    """One step's sequence lengths of the default workload (seeded)."""
    workload = Workload(cm.cfg.workload, seed=0)
    return [s.total_tokens for _ in range(cm.cfg.workload.prompts_per_step) for s in workload.new_group()]


# ---- the 1F1B bubble ----


def one_f_one_b_makespan(stages: int, micro: int, fwd: float = 1.0, bwd: float = 2.0) -> float:
    """Run the 1F1B schedule op by op: stage s does min(p-s-1, m) warm-up forwards, then alternates a
    forward and a backward, then drains its backwards; a forward waits for the previous stage's, a
    backward for the next stage's (the last stage's for its own forward)."""
    ops = []
    for s in range(stages):
        warm = min(stages - s - 1, micro)
        order = [("F", i) for i in range(warm)]
        for i in range(micro - warm):
            order += [("F", warm + i), ("B", i)]
        ops.append(order + [("B", i) for i in range(micro - warm, micro)])
    done: dict[tuple, float] = {}
    nxt, free = [0] * stages, [0.0] * stages
    while any(nxt[s] < len(ops[s]) for s in range(stages)):
        for s in range(stages):
            if nxt[s] == len(ops[s]):
                continue
            kind, i = ops[s][nxt[s]]
            if kind == "F":
                dep = ("F", s - 1, i) if s > 0 else None
            else:
                dep = ("B", s + 1, i) if s < stages - 1 else ("F", s, i)
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep else 0.0)
            free[s] = done[(kind, s, i)] = start + (fwd if kind == "F" else bwd)
            nxt[s] += 1
    return max(free)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro", [1, 2, 5, 8, 32])
def test_the_bubble_is_the_closed_form_and_the_schedule_agrees(stages, micro):
    assert tl.bubble_fraction(stages, micro) == pytest.approx((stages - 1) / (micro + stages - 1), rel=1e-15)
    idle = 1 - micro * 3.0 / one_f_one_b_makespan(stages, micro)  # busy time of a stage: m x (fwd + bwd)
    assert tl.bubble_fraction(stages, micro) == pytest.approx(idle, abs=1e-12)


@pytest.mark.parametrize(("pp", "mini_batches"), [(2, 1), (4, 1), (4, 4), (8, 2)])
def test_a_pipeline_step_idles_the_bubble_of_its_micro_batches(pp, mini_batches):
    cm = cost_model(*BARE, "model=qwen3-8b", f"train.pipeline_parallel={pp}", f"train.mini_batches={mini_batches}")
    lens, gpus = [1000] * 4096, 32
    s = step(cm, lens, gpus)
    dp = gpus // pp
    per_replica = sum(lens) / mini_batches / dp
    assert s.micro_batches == -(-per_replica // cm.cfg.train.micro_batch_tokens)
    pipeline = s.train_compute_s + s.tp_comm_s + s.p2p_s + s.bubble_s
    assert s.bubble_s / pipeline == pytest.approx(tl.bubble_fraction(pp, s.micro_batches))
    assert s.dp_exposed_s == 0.0  # the guard for the line above: ZeRO-3 traffic hides under the pipeline


# ---- epochs and mini-batches ----


def test_mini_batches_add_optimizer_steps_and_keep_the_compute():
    one = cost_model("model=qwen3-8b")
    four = cost_model("model=qwen3-8b", "train.mini_batches=4")
    lens, gpus = [1500, 300, 4096, 2000] * 256, 8  # one node: ZeRO-3 traffic hides under compute
    a, b = step(one, lens, gpus), step(four, lens, gpus)
    m, t, dev, c = one.model, one.cfg.train, one.device, one.cfg.costs
    optimizer_step = 2 * (2 + t.grad_bytes_per_param + t.optimizer_bytes_per_param) * m.params / gpus
    optimizer_step /= dev.hbm_bandwidth_gb_s * GB * c.hbm_efficiency
    assert (a.optimizer_steps, b.optimizer_steps) == (1, 4)
    assert b.optimizer_s == pytest.approx(4 * optimizer_step)
    assert b.train_compute_s == pytest.approx(a.train_compute_s)
    assert b.dp_exposed_s == a.dp_exposed_s == 0.0
    assert four.train_step_s(lens, gpus) - one.train_step_s(lens, gpus) == pytest.approx(3 * optimizer_step)


@pytest.mark.parametrize(("epochs", "mini_batches"), [(2, 1), (3, 1), (2, 4)])
def test_ppo_epochs_repeat_the_training_passes_but_not_the_forward_only_ones(epochs, mini_batches):
    common = ("model=qwen3-8b", "train.reference_model=true")
    base = cost_model(*common)
    more = cost_model(*common, f"train.ppo_epochs={epochs}", f"train.mini_batches={mini_batches}")
    lens, gpus = [1500, 300, 4096, 2000] * 256, 8
    a, b = step(base, lens, gpus), step(more, lens, gpus)
    assert b.optimizer_steps == epochs * mini_batches
    assert b.train_compute_s == pytest.approx(epochs * a.train_compute_s)
    assert b.forward_compute_s == pytest.approx(a.forward_compute_s)  # log-probs and reference: once a step
    assert b.optimizer_s == pytest.approx(epochs * mini_batches * a.optimizer_s)
    assert b.overhead_s == a.overhead_s
    assert b.total_s == pytest.approx(
        a.total_s + (epochs - 1) * a.train_compute_s + (epochs * mini_batches - 1) * a.optimizer_s
    )


# ---- recompute ----


def test_recompute_trades_compute_for_memory():
    lens, gpus = [3000] * 512, 8
    runs = {mode: cost_model("model=qwen3-8b", f"train.activation_recompute={mode}") for mode in RECOMPUTE}
    compute = {mode: step(cm, lens, gpus).train_compute_s for mode, cm in runs.items()}
    memory = {mode: tl.memory(cm.cfg, cm.model, cm.device, gpus).activations_gb for mode, cm in runs.items()}
    assert compute["full"] == pytest.approx(4 / 3 * compute["none"])  # one more forward of three
    assert compute["none"] < compute["selective"] < compute["full"]
    assert memory["none"] > memory["selective"] > memory["full"]


def test_activations_against_a_list_of_the_tensors_a_layer_keeps():
    """No recompute, Qwen3-32B, one GPU: every tensor a layer keeps for its backward, in bf16 elements
    per token, plus the logits; tensor parallelism (with sequence parallelism) divides it all."""
    cm = cost_model("train.activation_recompute=none")
    m = cm.model
    kept = {
        "attention norm input": 5120,
        "attention norm output": 5120,
        "q (64 heads x 128)": 8192,
        "k (8 kv heads x 128)": 1024,
        "v": 1024,
        "attention output": 8192,
        "mlp norm input": 5120,
        "mlp norm output": 5120,
        "gate": 25600,
        "up": 25600,
        "silu(gate) * up": 25600,
    }
    per_token = 2 * (64 * sum(kept.values()) + m.vocab)
    for tp in (1, 2, 8):
        lay = tl.Layout(tp, 1, 8 // tp, 64, 1.0, 1.0, 1.0)
        assert tl.activation_bytes(m, lay, "none", 4096) == pytest.approx(per_token * 4096 / tp)
    # A chunked loss holds `chunk` tokens' fp32 logits and log-softmax instead of every token's bf16 logits.
    layers_only = 2 * 64 * sum(kept.values()) * 4096
    lay = tl.Layout(1, 1, 8, 64, 1.0, 1.0, 1.0)
    assert tl.activation_bytes(m, lay, "none", 4096, 1024) == pytest.approx(layers_only + 2 * 4 * m.vocab * 1024)
    assert tl.activation_bytes(m, lay, "none", 512, 1024) == pytest.approx(layers_only / 8 + 2 * 4 * m.vocab * 512)
    chunked = cost_model("train.activation_recompute=none", "train.logit_chunk_tokens=1024")
    assert chunked.train_memory_gb(8) - cm.train_memory_gb(8) == pytest.approx(
        (8 * m.vocab * 1024 - 2 * m.vocab * chunked.cfg.train.micro_batch_tokens) / GB
    )
    with pytest.raises(UserError, match="train.logit_chunk_tokens must be null .* or an integer >= 1, got 0"):
        cost_model("train.logit_chunk_tokens=0")


# ---- the layout's traffic ----


def test_tensor_parallel_all_reduces_against_a_hand_count():
    """tp=8 on one node, full recompute: 6 all-reduces of each layer's bf16 activations per token
    (2 forward, 2 recomputed forward, 2 backward), each moving 2 x 7/8 of the message over NVLink."""
    cm = cost_model(*BARE, "model=qwen3-8b", "train.tensor_parallel=8")
    lens = [2000] * 64
    s = step(cm, lens, 8)
    m, dev, c = cm.model, cm.device, cm.cfg.costs
    expected = sum(lens) * m.layers * 6 * (2 * 7 / 8) * m.hidden * 2 / (dev.nvlink_gb_s * GB * c.nvlink_efficiency)
    assert s.tp_comm_s == pytest.approx(expected)
    assert s.p2p_s == s.bubble_s == s.dp_exposed_s == 0.0


def test_zero3_traffic_shows_when_it_outlasts_the_compute():
    """32 GPUs over the network, 64 small optimizer steps: each mini-batch is one micro-batch whose
    parameter all-gathers (forward and backward, bf16) and gradient reduce-scatter (fp32) take longer
    than its compute, so the pass lasts as long as that traffic."""
    cm = cost_model(*BARE, "model=qwen3-8b", "train.mini_batches=64")
    lens, gpus = [500] * 4096, 32
    s = step(cm, lens, gpus)
    m, dev, c = cm.model, cm.device, cm.cfg.costs
    traffic = 64 * (2 + 2 + 4) * m.params * 31 / 32 / (dev.network_gb_s * GB * c.network_efficiency)
    assert s.micro_batches == 1
    assert s.dp_exposed_s > 0
    assert s.train_compute_s + s.dp_exposed_s == pytest.approx(traffic)


# ---- what does not fit ----


def test_tensor_parallel_beyond_a_node_is_refused():
    with pytest.raises(UserError, match=r"train.tensor_parallel=16 must divide the 8 GPUs of a node"):
        load_config(overrides=["train.tensor_parallel=16"])


def test_tp_times_pp_must_divide_the_train_gpus():
    cm = cost_model("train.tensor_parallel=4", "train.pipeline_parallel=3")
    expected = r"train.tensor_parallel=4 x train.pipeline_parallel=3 = 12 does not divide the 32 train GPUs"
    with pytest.raises(UserError, match=expected):
        cm.check_fits(train_gpus=32, max_request_tokens=1000, colocated=False)
    with pytest.raises(UserError, match=expected):
        cm.train_step_s([1000] * 64, 32)


def test_a_train_mfu_the_hardware_cannot_reach_with_recompute_is_refused():
    cm = cost_model("costs.train_mfu=0.8")
    with pytest.raises(UserError, match=r"costs.train_mfu=0.8 .* 1.07 of its peak; at most 0.75"):
        cm.check_fits(train_gpus=32, max_request_tokens=1000, colocated=False)


def test_short_memory_names_the_activations_and_their_size():
    cm = cost_model("train.activation_recompute=none", "train.tensor_parallel=8")
    lay = tl.layout(cm.cfg, cm.model, cm.device, 32)
    need = tl.activation_bytes(cm.model, lay, "none", 32768) / GB
    assert need == pytest.approx(62, abs=1)
    expected = (
        rf"activations of a 32768-token micro-batch need {need:.1f} GB per GPU with activation_recompute=none; "
        r"enable recompute \(train.activation_recompute=full\), lower train.micro_batch_tokens or raise "
        r"train.tensor_parallel"
    )
    with pytest.raises(UserError, match=expected):
        cm.check_fits(train_gpus=32, max_request_tokens=18432, colocated=False)
    cost_model("train.activation_recompute=selective", "train.tensor_parallel=8").check_fits(32, 18432, False)


def test_a_sequence_longer_than_a_micro_batch_is_a_micro_batch_of_its_own():
    cm = cost_model("train.activation_recompute=none", "train.tensor_parallel=2", "train.micro_batch_tokens=4096")
    with pytest.raises(UserError, match=r"a 18432-token micro-batch .* micro-batch of its own.* maximum lengths"):
        cm.check_fits(train_gpus=32, max_request_tokens=18432, colocated=False)


def test_short_memory_names_the_sharded_state_when_it_is_the_larger_part():
    cm = cost_model()
    with pytest.raises(UserError, match=r"optimizer state need 73.7 GB per GPU, ZeRO-3 sharded .*; add train GPUs"):
        cm.check_fits(train_gpus=8, max_request_tokens=1000, colocated=False)


# ---- padded micro-batches (train.micro_batch_sequences) ----


def test_padded_shards_give_whole_groups_to_the_lightest_replica_and_pad_each_micro_batch():
    # Groups of 2: (10,10) 20 tokens, (50,50) 100, (30,30) 60, (5,5) 10. Largest first to the lightest
    # replica: 100 -> r0, 60 -> r1, 20 -> r1 (80), 10 -> r1 (90).
    lens = [10, 10, 50, 50, 30, 30, 5, 5]
    assert tl.padded_shards(lens, 2, 2, 8) == [[50, 50], [30] * 6]  # one micro-batch each, padded to its longest
    # Micro-batches of at most 4: 6 sequences sorted, 2 near-equal slices of 3, each padded to its longest.
    assert tl.padded_shards(lens, 2, 2, 4)[1] == [10, 10, 10, 30, 30, 30]
    assert tl.padded_shards(lens, 2, 1, 3) == [[5, 5, 30, 30, 30, 50, 50, 50]]  # 3 slices: 2, 3, 3
    assert tl.padded_shards([7, 3], 2, 3, 8) == [[7, 7], [], []]  # a replica without a group gets none
    assert tl.padded_shards([4, 9, 2], 2, 1, 64) == [[9, 9, 9]]  # a last, shorter group


def test_a_padded_step_costs_the_padded_tokens_of_its_slowest_replica():
    packed = cost_model(*BARE, "train.activation_recompute=none", "workload.group_size=2")
    padded = cost_model(*BARE, "train.activation_recompute=none", "workload.group_size=2",
                        "train.micro_batch_sequences=4")  # fmt: skip
    lens = [100, 100, 2000, 2000, 300, 300, 700, 700]
    one = step(padded, lens, 1)
    # one replica: its sorted sequences in 2 slices of 4, padded to 300 and 2000
    expected = step(packed, [300] * 4 + [2000] * 4, 1)
    assert one.train_compute_s == pytest.approx(expected.train_compute_s, rel=1e-12)
    assert one.micro_batches == 2
    assert one.train_compute_s > step(packed, lens, 1).train_compute_s  # padding costs compute
    # eight replicas of the same kind of GPU, two with a group: the (2000, 2000) one sets the pace
    many = step(padded, lens, 8)
    assert many.train_compute_s == pytest.approx(step(packed, [2000, 2000] * 8, 8).train_compute_s, rel=1e-12)
    # the same length everywhere pads nothing
    even = [512] * 8
    assert step(padded, even, 1).train_compute_s == pytest.approx(step(packed, even, 1).train_compute_s, rel=1e-12)


def test_a_padded_micro_batch_holds_its_sequences_at_the_longest_length():
    cm = cost_model("train.micro_batch_sequences=8")
    mem = tl.memory(cm.cfg, cm.model, cm.device, 32, longest=3000)
    assert mem.micro_batch_tokens == 8 * 3000
    with pytest.raises(UserError, match=r"8 sequences padded to 30000 tokens.*lower train.micro_batch_sequences"):
        cm.check_fits(train_gpus=32, max_request_tokens=30000, colocated=False)


@pytest.mark.parametrize("bad", ["0", "-3", "2.5", "true"])
def test_a_bad_micro_batch_sequences_is_refused_by_name(bad):
    with pytest.raises(UserError, match=r"train.micro_batch_sequences.? must be .*integer"):
        load_config(overrides=[f"train.micro_batch_sequences={bad}"])


# ---- attention at its own efficiency in training (costs.train_attention_mfu) ----


@pytest.mark.parametrize("recompute, attention_passes", [("none", 3), ("selective", 4), ("full", 4)])
def test_training_attention_runs_at_its_own_efficiency(recompute, attention_passes):
    args = (*BARE, f"train.activation_recompute={recompute}", "costs.train_mfu=0.4")
    lens = [4096, 8192, 1000]
    base = step(cost_model(*args), lens, 8)
    assert step(cost_model(*args, "costs.train_attention_mfu=0.4"), lens, 8).train_compute_s == pytest.approx(
        base.train_compute_s, rel=1e-12
    )
    slow = step(cost_model(*args, "costs.train_attention_mfu=0.2"), lens, 8)
    cm = cost_model(*args)
    attention = tl.forward_split(cm.model, lens).attention
    at_mfu = attention / (8 * cm.device.peak_tflops * TFLOP * 0.4 * tl.HFU_PER_MFU)  # one pass's, 8 GPUs
    assert slow.train_compute_s - base.train_compute_s == pytest.approx(attention_passes * at_mfu, rel=1e-9)


# ---- the default is the old model ----


def old_train_step_s(cm: CostModel, seq_lens: list[int], gpus: int) -> float:
    """The training cost before layouts existed: FSDP over every train GPU, one optimizer step."""
    m, t, c, dev = cm.model, cm.cfg.train, cm.cfg.costs, cm.device
    pairs = sum(n * n / 2 for n in seq_lens)
    fwd = 2 * m.matmul_params * sum(seq_lens) + 4 * m.layers * m.attn_dim * pairs
    peak = gpus * dev.peak_tflops * TFLOP
    seconds = 3 * fwd / (peak * c.train_mfu)
    seconds += (int(t.recompute_logprobs) + int(t.reference_model)) * fwd / (peak * c.logprob_mfu)
    state = (2 + t.grad_bytes_per_param + t.optimizer_bytes_per_param) * m.params / gpus
    seconds += 2 * state / (dev.hbm_bandwidth_gb_s * GB * c.hbm_efficiency)
    return seconds + c.train_step_overhead_s


@pytest.mark.parametrize("gpus", [16, 32, 64])
def test_the_default_layout_costs_what_the_old_model_did(gpus):
    cm = cost_model()
    lens = default_batch(cm)
    assert cm.train_step_s(lens, gpus) == pytest.approx(old_train_step_s(cm, lens, gpus), rel=1e-12)
    parts = step(cm, lens, gpus)
    assert parts.tp_comm_s == parts.p2p_s == parts.bubble_s == parts.dp_exposed_s == 0.0
