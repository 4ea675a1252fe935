"""The trainer's cost: its parallel layout, the seconds of one RL step, and its memory per GPU.

One RL step makes `train.ppo_epochs` passes over the batch; each pass is split into
`train.mini_batches` mini-batches of equal tokens, and each mini-batch is a forward + backward and
one optimizer step. Within a mini-batch every data-parallel replica packs whole sequences into
micro-batches of at most `train.micro_batch_tokens` tokens. Before the update the batch goes once
through forward-only passes (the behaviour policy's log-probs, a reference model).

The train GPUs are tensor_parallel (tp) x pipeline_parallel (pp) x data parallel (dp), ranked as
Megatron-LM ranks them: tensor parallel innermost (within a node), pipeline outermost.

- compute: FLOPs / (peak x utilisation), spread over the GPUs; when pp does not divide the layers
  the stage with the most layers sets the pace;
- tensor parallel: all-reduces of each layer's activations over NVLink, not overlapped;
- pipeline: a 1F1B schedule, idle (p-1)/(m+p-1) of the pipeline time, plus point-to-point sends of
  activations and gradients between stages;
- data parallel: ZeRO-3 / FSDP: parameters all-gathered and gradients reduce-scattered for every
  micro-batch, overlapped with the compute (prefetch), so only traffic beyond it shows;
- optimizer: one read and one write of the GPU's shard of the state per optimizer step;
- expert parallel (MoE, `train.expert_parallel` = ep): each group of ep data-parallel replicas shards the
  routed experts, E/ep whole experts a replica (Megatron-LM's expert parallelism). Every MoE layer sends
  each token's hidden state to its experts and back (an all-to-all dispatch and combine) in the forward,
  again in the backward and in a recomputed forward, not overlapped; the experts' ZeRO-3 gathers and
  reduce-scatters run over the dp/ep replicas that hold the same experts, and a gathered MoE layer holds
  only its E/ep experts. The state per GPU is unchanged (ZeRO-3 shards it over every GPU either way).

With `train.micro_batch_sequences` = N the trainer pads instead of packing, as the reference runtime's
does (reference/trainer/trainer.py): whole groups go to the data-parallel replicas, largest first, each
to the replica with the fewest real tokens so far (reference/control/executor.py `_shard`); a replica
sorts its sequences by length and slices them into ceil(n / N) near-equal micro-batches, each padded to
its longest. Every pass then computes the padded tokens, and the step waits for the replica whose padded
sequences cost the most (`padded_shards`).

Departures from a real trainer: packed micro-batches and pipeline stages are balanced (no packing loss;
the embedding and output head are spread over the stages like the layers); no context parallelism,
so a sequence longer than `micro_batch_tokens` is a micro-batch on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from core.errors import UserError
from core.specs import BF16_BYTES, DeviceSpec, ModelSpec
from sim.config import SimConfig

GB = 1e9  # the units of sim.cost
FP32_BYTES = 4
TFLOP = 1e12

# costs.train_mfu counts model FLOPs (forward + backward = 3 forwards) of a run that recomputes every
# layer's forward (4 forwards executed): MFU as the PaLM paper defines it (Chowdhery et al. 2022,
# appendix B), excluding rematerialisation. The hardware FLOPs utilisation (HFU, Korthikanti et al.
# 2022, "Reducing Activation Recomputation in Large Transformer Models") is then 4/3 of it, and the
# other recompute modes execute fewer FLOPs at that HFU. Assumption: the default's train_mfu was
# read off runs with full recomputation, the default layout.
HFU_PER_MFU = 4 / 3
# Megatron-LM tensor parallelism all-reduces each layer's activations twice in the forward (after
# attention's output projection and the MLP's down projection) and twice in the backward (Shoeybi et
# al. 2019, "Megatron-LM", fig. 4); a recomputed forward repeats the forward's two. Sequence
# parallelism swaps each for an all-gather plus a reduce-scatter of the same volume (Korthikanti et
# al. 2022, sec. 4.2.2), which is why activations are split over tp below.
TP_ALLREDUCES_FORWARD = 2
TP_ALLREDUCES_BACKWARD = 2


# How the host's launches of an eager pass (costs.*_layer_host_s) and the device's work on it combine: the
# 2-norm of the two, the larger alone when one dominates and sqrt(2) x either when they are equal. The host
# runs ahead of the device only as far as its launch queue lets it, so the two overlap partly. Fitted freely
# to the H200 profile, the exponent comes out between 1.6 and 3.3 by part (prefill, log-prob, training); 2
# fits each within a point or two of its own best (sim/calibration.py).
def overlap(device_s: float, host_s: float) -> float:
    """Seconds of a pass whose device work takes `device_s` and whose kernel launches take `host_s`."""
    return math.hypot(device_s, host_s) if host_s > 0 else device_s


def ring_allreduce_factor(n: int) -> float:
    """Bytes each of n GPUs sends per byte all-reduced, ring algorithm (NCCL-tests PERFORMANCE.md,
    "bus bandwidth"); all-gather and reduce-scatter send half of it, (n-1)/n."""
    return 2 * (n - 1) / n


def alltoall_bytes(model: ModelSpec, tokens: float, ep: int) -> float:
    """Bytes one GPU sends in one all-to-all of one MoE layer (a dispatch; the combine sends as many back)
    when it holds `tokens` tokens: each token's bf16 hidden state goes to each of its experts_per_token
    experts, (ep-1)/ep of them on other GPUs of the ep group under uniform routing. One copy per (token,
    expert) pair, as Megatron-LM's all-to-all token dispatcher sends; DeepEP sends a token once per GPU
    (fewer bytes when two of its experts share one). 0 at ep = 1."""
    if ep == 1:
        return 0.0
    return tokens * model.experts_per_token * model.hidden * BF16_BYTES * (ep - 1) / ep


def routed_expert_params(model: ModelSpec) -> int:
    """Every routed expert of every MoE layer (0 for a dense model)."""
    return model.moe_layers * model.experts * model.expert_params


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Share of a 1F1B pipeline's time a stage idles: (p-1)/(m+p-1), from the bubble of p-1
    micro-batch slots against m slots of work (Narayanan et al. 2021, "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2)."""
    return (stages - 1) / (micro_batches + stages - 1)


@dataclass(frozen=True)
class Layout:
    """How the train GPUs split, and the bytes/s each group's traffic gets per GPU."""

    tp: int
    pp: int
    dp: int
    stage_layers: int  # layers of the largest pipeline stage
    tp_link: float  # NVLink (tp never leaves a node)
    pp_link: float  # NVLink if the whole trainer is one node, else the network
    dp_link: float  # NVLink if a data-parallel group (tp x dp GPUs) is within a node, else the network
    ep: int = 1  # expert parallel: data-parallel replicas sharing out the routed experts
    ep_link: float = 0.0  # NVLink if an expert-parallel group (tp x ep GPUs) is within a node, else the network
    alltoall_latency_s: float = 0.0  # fixed seconds of one all-to-all


def layout(cfg: SimConfig, model: ModelSpec, device: DeviceSpec, train_gpus: int) -> Layout:
    """The layout of `train_gpus` GPUs; UserError naming the keys when tp x pp does not divide them."""
    t, c = cfg.train, cfg.costs
    tp, pp = t.tensor_parallel, t.pipeline_parallel
    if train_gpus % (tp * pp):
        raise UserError(
            f"train.tensor_parallel={tp} x train.pipeline_parallel={pp} = {tp * pp} does not divide the "
            f"{train_gpus} train GPUs (data parallel = train GPUs / (tensor_parallel x pipeline_parallel))"
        )
    if pp > model.layers:
        raise UserError(f"train.pipeline_parallel={pp} exceeds the {model.layers} layers of {model.name}")
    if c.train_mfu * HFU_PER_MFU > 1:
        raise UserError(
            f"costs.train_mfu={c.train_mfu} counts model FLOPs of runs with full recompute, which execute 4/3 "
            f"of them: the hardware would run at {c.train_mfu * HFU_PER_MFU:.2f} of its peak; at most 0.75"
        )
    dp, ep = train_gpus // (tp * pp), t.expert_parallel
    if dp % ep:
        raise UserError(
            f"train.expert_parallel={ep} does not divide the data-parallel size {dp} (= {train_gpus} train GPUs / "
            f"(tensor_parallel={tp} x pipeline_parallel={pp})): experts are sharded over data-parallel replicas"
        )
    nvlink = device.nvlink_gb_s * GB * c.nvlink_efficiency
    network = device.network_gb_s * GB * c.network_efficiency
    node = device.gpus_per_node
    return Layout(
        tp,
        pp,
        dp,
        -(-model.layers // pp),
        nvlink,
        nvlink if train_gpus <= node else network,
        nvlink if tp * dp <= node else network,
        ep,
        nvlink if tp * ep <= node else network,
        c.alltoall_latency_s,
    )


# ---- step time ----


@dataclass(frozen=True)
class TrainStep:
    """Seconds of one RL step by where they go (their sum is `total_s`), and its schedule."""

    train_compute_s: float  # forward + backward (+ recomputation), every epoch and mini-batch
    forward_compute_s: float  # forward-only passes: behaviour log-probs, reference model
    tp_comm_s: float  # tensor-parallel all-reduces
    ep_comm_s: float  # expert-parallel all-to-alls (0 without expert parallelism)
    p2p_s: float  # pipeline sends between stages
    bubble_s: float  # 1F1B fill and drain
    dp_exposed_s: float  # ZeRO-3 traffic beyond the compute it overlaps
    host_exposed_s: float  # the host's kernel launches beyond the compute they overlap (`overlap`)
    optimizer_s: float
    overhead_s: float
    optimizer_steps: int
    micro_batches: int  # per mini-batch and data-parallel replica

    @property
    def total_s(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name.endswith("_s"))


@dataclass(frozen=True)
class _Pass:
    """One pass of `tokens` tokens (all replicas) through the layout; seconds per GPU by part."""

    compute: float
    tp_comm: float
    ep_comm: float
    p2p: float
    bubble: float
    dp_exposed: float
    micro_batches: int
    host_exposed: float = 0.0


def _scaled(p: _Pass, share: float) -> _Pass:
    """A pass doing `share` of its samples' work (the gradients' reduction over the replicas stays whole)."""
    return replace(
        p,
        compute=p.compute * share,
        tp_comm=p.tp_comm * share,
        ep_comm=p.ep_comm * share,
        p2p=p.p2p * share,
        bubble=p.bubble * share,
        host_exposed=p.host_exposed * share,
    )


def _run_pass(
    lay: Layout,
    model: ModelSpec,
    *,
    tokens: float,
    flops: float,
    flops_per_s: float,
    micro_tokens: int,
    allreduces: int,
    sends: int,
    dp_bytes_per_param: float,
    alltoalls: int,
    layer_host_s: float = 0.0,
    micro_batches: int | None = None,
) -> _Pass:
    """`tokens` and `flops` of the pass over all replicas, at `flops_per_s` per GPU; `allreduces` per
    layer and token (tensor parallel), `sends` per token between stages (activations forward, gradients
    back), `dp_bytes_per_param` of ZeRO-3 traffic per micro-batch and parameter of a model-parallel shard,
    `alltoalls` per MoE layer and micro-batch (expert parallel), `layer_host_s` of the host's launches per
    layer and micro-batch; `micro_batches` a replica (None: its tokens packed into `micro_tokens`)."""
    per_replica = tokens / lay.dp
    m = micro_batches or max(1, math.ceil(per_replica / micro_tokens))
    stage_share = lay.stage_layers / model.layers  # of the model's work, on the slowest stage
    compute = flops * stage_share / (lay.tp * lay.dp) / flops_per_s
    host_exposed = overlap(compute, m * lay.stage_layers * layer_host_s) - compute
    layer_act = per_replica * model.hidden * BF16_BYTES  # one layer's output, every micro-batch
    tp_comm = layer_act * lay.stage_layers * allreduces * ring_allreduce_factor(lay.tp) / lay.tp_link
    # Megatron's scatter/gather optimisation sends 1/tp of each activation per GPU (Narayanan et al. 2021, sec. 4.1)
    p2p = layer_act / lay.tp * sends / lay.pp_link if lay.pp > 1 else 0.0
    ep_comm = _alltoall_s(lay, model, per_replica, m, alltoalls) if lay.ep > 1 else 0.0
    busy = compute + host_exposed + tp_comm + p2p + ep_comm
    bubble = busy / (1 - bubble_fraction(lay.pp, m)) - busy
    if lay.ep == 1:
        shard = model.params * stage_share / lay.tp
        dp_comm = m * dp_bytes_per_param * shard * (lay.dp - 1) / lay.dp / lay.dp_link
    else:  # the experts' shards travel among the dp/ep replicas that hold the same experts
        experts = routed_expert_params(model) * stage_share / lay.tp
        edp = lay.dp // lay.ep
        dense = ((model.params * stage_share / lay.tp) - experts) * (lay.dp - 1) / lay.dp
        dp_comm = m * dp_bytes_per_param * (dense + experts / lay.ep * (edp - 1) / edp) / lay.dp_link
    return _Pass(compute, tp_comm, ep_comm, p2p, bubble, max(0.0, dp_comm - busy - bubble), m, host_exposed)


def _alltoall_s(lay: Layout, model: ModelSpec, per_replica: float, micro_batches: int, alltoalls: int) -> float:
    """Seconds of a pass's all-to-alls on the slowest stage: `alltoalls` per MoE layer and micro-batch,
    each GPU sending its tokens (a replica's, split over tp by sequence parallelism) to their experts."""
    moe_layers = lay.stage_layers * model.moe_layers / model.layers  # on the slowest stage, balanced
    sent = alltoall_bytes(model, per_replica / lay.tp, lay.ep)
    return moe_layers * alltoalls * (sent / lay.ep_link + micro_batches * lay.alltoall_latency_s)


def forward_flops(model: ModelSpec, seq_lens: list[int]) -> float:
    """FLOPs of one forward over these sequences: matmuls plus causal attention (QK^T and AV)."""
    pairs = sum(n * n / 2 for n in seq_lens)
    return 2 * model.matmul_params * sum(seq_lens) + 4 * model.layers * model.attn_dim * pairs


@dataclass(frozen=True, slots=True)
class Flops:
    """A forward pass's FLOPs by kind: each runs at its own share of the peak."""

    matmul: float  # the parameters' matmuls (an MoE model's active ones)
    attention: float  # QK^T and AV


def forward_split(model: ModelSpec, seq_lens: list[int]) -> Flops:
    """`forward_flops` by kind."""
    pairs = sum(n * n / 2 for n in seq_lens)
    return Flops(matmul=2 * model.matmul_params * sum(seq_lens), attention=4 * model.layers * model.attn_dim * pairs)


def forward_s(
    model: ModelSpec,
    device: DeviceSpec,
    seq_len: int,
    mfu: float,
    attention_mfu: float | None = None,
    layer_host_s: float = 0.0,
) -> float:
    """Seconds of one forward (log-prob) pass over one sequence on one GPU, its matmuls at `mfu` of the
    device's peak and its attention at `attention_mfu` (None: `mfu`), the host's launches `layer_host_s` a
    layer overlapping them partly: what a profile's log-prob points measure."""
    flops = forward_split(model, [seq_len])
    peak = device.peak_tflops * TFLOP
    compute = flops.matmul / (peak * mfu) + flops.attention / (peak * (attention_mfu or mfu))
    return overlap(compute, model.layers * layer_host_s)


def recompute_flops(model: ModelSpec, seq_lens: list[int], mode: str) -> float:
    """FLOPs repeated in the backward: a whole forward (full), the attention core (selective), none."""
    if mode == "full":
        return forward_flops(model, seq_lens)
    if mode == "selective":
        return 4 * model.layers * model.attn_dim * sum(n * n / 2 for n in seq_lens)
    return 0.0


def padded_shards(seq_lens: list[int], group_size: int, replicas: int, per_micro: int) -> list[list[int]]:
    """Each data-parallel replica's sequences as a padding trainer computes them (see the module docstring):
    `seq_lens` comes as whole groups, runs of `group_size` (the last may be shorter); each replica's lengths
    come back sorted, every micro-batch of at most `per_micro` sequences padded to its longest. A replica
    left without a group gets []."""
    groups = [seq_lens[i : i + group_size] for i in range(0, len(seq_lens), group_size)]
    load, shards = [0] * replicas, [[] for _ in range(replicas)]
    for group in sorted(groups, key=lambda g: -sum(g)):  # stable: ties keep the groups' order
        r = min(range(replicas), key=lambda i: (load[i], i))
        load[r] += sum(group)
        shards[r] += group
    out = []
    for shard in shards:
        lens, n = sorted(shard), len(shard)
        count = -(-n // per_micro)
        bounds = [(i * n // count, (i + 1) * n // count) for i in range(count)]
        out.append([lens[hi - 1] for lo, hi in bounds for _ in range(hi - lo)])
    return out


def step(cfg: SimConfig, model: ModelSpec, device: DeviceSpec, seq_lens: list[int], train_gpus: int) -> TrainStep:
    """One RL step's training over sequences of these lengths on `train_gpus` GPUs."""
    t, c = cfg.train, cfg.costs
    lay = layout(cfg, model, device, train_gpus)
    micro_batches = None
    if t.micro_batch_sequences is not None and seq_lens:
        # The replica whose padded sequences cost the most sets the pace; every replica is costed as it.
        shards = padded_shards(seq_lens, cfg.workload.group_size, lay.dp, t.micro_batch_sequences)
        slowest = max(shards, key=lambda s: forward_flops(model, s))
        micro_batches = max(1, -(-len(slowest) // t.micro_batch_sequences))
        seq_lens = slowest * lay.dp
    tokens, fwd = sum(seq_lens), forward_flops(model, seq_lens)
    micro_tokens = max(t.micro_batch_tokens, max(seq_lens, default=0))
    peak = device.peak_tflops * TFLOP
    steps = t.ppo_epochs * t.mini_batches
    recompute = t.activation_recompute
    split = forward_split(model, seq_lens)  # attention at its own efficiency: as matmul FLOPs
    matmul, attention = split.matmul, split.attention
    train_flops = 3 * fwd + recompute_flops(model, seq_lens, recompute)
    if c.train_attention_mfu is not None:
        attention_flops = 3 * attention + (attention if recompute in ("full", "selective") else 0.0)
        train_flops += attention_flops * (c.train_mfu / c.train_attention_mfu - 1)
    train = _run_pass(
        lay,
        model,
        tokens=tokens / t.mini_batches,
        flops=train_flops / t.mini_batches,
        flops_per_s=peak * c.train_mfu * HFU_PER_MFU,
        micro_tokens=micro_tokens,
        allreduces=TP_ALLREDUCES_FORWARD * (2 if recompute == "full" else 1) + TP_ALLREDUCES_BACKWARD,
        sends=2,
        dp_bytes_per_param=2 * BF16_BYTES + t.grad_bytes_per_param,  # gather twice, reduce-scatter once
        alltoalls=2 * (2 if recompute == "full" else 1) + 2,  # dispatch + combine: forward (again), backward
        layer_host_s=c.train_layer_host_s,
        micro_batches=micro_batches and -(-micro_batches // t.mini_batches),
    )
    # Samples with no gradient (train.zero_advantage_share, z): forward only (a third of a training pass) in
    # the first pass, skipped in the later ones; their share of every pass's time goes with them.
    z, epochs = t.zero_advantage_share, t.ppo_epochs
    kept = ((1.0 - z) + z / 3.0 + (epochs - 1) * (1.0 - z)) / epochs
    if kept != 1.0:
        train = _scaled(train, kept)
    forwards = int(t.recompute_logprobs) + int(t.reference_model)
    scaled = fwd if c.logprob_attention_mfu is None else matmul + attention * c.logprob_mfu / c.logprob_attention_mfu
    fwd_pass = _run_pass(
        lay,
        model,
        tokens=tokens,
        flops=scaled,
        flops_per_s=peak * c.logprob_mfu,
        micro_tokens=micro_tokens,
        allreduces=TP_ALLREDUCES_FORWARD,
        sends=1,
        dp_bytes_per_param=BF16_BYTES,
        alltoalls=2,
        layer_host_s=c.logprob_layer_host_s,
        micro_batches=micro_batches,
    )
    state = (BF16_BYTES + t.grad_bytes_per_param + t.optimizer_bytes_per_param) * model.params / train_gpus
    return TrainStep(
        train_compute_s=steps * train.compute,
        forward_compute_s=forwards * fwd_pass.compute,
        tp_comm_s=steps * train.tp_comm + forwards * fwd_pass.tp_comm,
        ep_comm_s=steps * train.ep_comm + forwards * fwd_pass.ep_comm,
        p2p_s=steps * train.p2p + forwards * fwd_pass.p2p,
        bubble_s=steps * train.bubble + forwards * fwd_pass.bubble,
        dp_exposed_s=steps * train.dp_exposed + forwards * fwd_pass.dp_exposed,
        host_exposed_s=steps * train.host_exposed + forwards * fwd_pass.host_exposed,
        optimizer_s=steps * 2 * state / (device.hbm_bandwidth_gb_s * GB * c.hbm_efficiency),  # read + write
        overhead_s=c.train_step_overhead_s + (c.train_dp_overhead_s if lay.dp > 1 else 0.0),  # once per RL step
        optimizer_steps=steps,
        micro_batches=train.micro_batches,
    )


# ---- memory ----


@dataclass(frozen=True)
class TrainMemory:
    """GB per GPU the trainer needs at its peak, by part (on the busiest GPU of the layout)."""

    state_gb: float  # bf16 weights, gradients, optimizer state (and a reference model's weights), sharded over all
    buffers_gb: float  # ZeRO-3: unsharded layers in use (two layers' bf16 weights, one layer's gradients) and the
    # root unit's bf16 weights and gradients (embeddings, lm_head), gathered for the whole step
    activations_gb: float
    micro_batch_tokens: int
    estimated: bool  # activations estimated from the model shape (False: the train.activation_gb override)

    @property
    def total_gb(self) -> float:
        return self.state_gb + self.buffers_gb + self.activations_gb


def layer_activation_bytes(model: ModelSpec, mode: str) -> tuple[int, int]:
    """(bytes kept per token and layer until the backward, bytes of one layer recomputed at a time).

    Counted from a Qwen3/Llama layer as Korthikanti et al. 2022 (sec. 4.1) count a GPT layer: bf16,
    no dropout, FlashAttention (no seq x seq scores kept: Dao et al. 2022). Attention keeps its norm's
    input and output (2h), Q, K and V (a + 2kv) and the output projection's input (a); the MLP keeps
    its norm's input and output (2h), gate and up outputs (2i) and the down projection's input (i).
    selective recomputes the attention core and the norms (Megatron Core recompute_modules core_attn,
    layernorm), dropping the output projection's input and the norm outputs; full keeps each layer's
    input (h) and rebuilds one whole layer at a time."""
    h, a, i = model.hidden, model.attn_dim, model.intermediate
    kv = model.kv_heads * model.head_dim
    whole = BF16_BYTES * (4 * h + 2 * a + 2 * kv + 3 * i)
    if mode == "full":
        return BF16_BYTES * h, whole
    if mode == "selective":
        return BF16_BYTES * (2 * h + a + 2 * kv + 3 * i), 0
    return whole, 0


def activation_bytes(model: ModelSpec, lay: Layout, mode: str, tokens: int, logit_chunk: int | None = None) -> float:
    """Peak activation bytes per GPU for micro-batches of `tokens` tokens. 1F1B keeps up to pp
    micro-batches in flight on the first stage (Narayanan et al. 2021, sec. 2.2; the worst case is
    taken); the last stage keeps one, plus its logits (`logit_bytes`). Tensor parallelism with sequence
    parallelism splits all of it over tp (Korthikanti et al.)."""
    kept, rebuilt = layer_activation_bytes(model, mode)
    first = (lay.pp * lay.stage_layers * kept + rebuilt) * tokens
    last = (lay.stage_layers * kept + rebuilt) * tokens + logit_bytes(model, tokens, logit_chunk)
    return max(first, last) / lay.tp


def logit_bytes(model: ModelSpec, tokens: int, chunk: int | None = None) -> float:
    """The loss's logits at their peak: one bf16 copy of every token's (`chunk` None: assumption, a fused
    log-prob kernel), or `chunk` tokens' at a time in fp32, the logits and their log-softmax (the reference
    runtime's chunked loss, `reference/trainer/loss.py`; measured: benchmarks/trainer_memory.py)."""
    if chunk is None:
        return BF16_BYTES * model.vocab * tokens
    return 2 * FP32_BYTES * model.vocab * min(tokens, chunk)


def memory(cfg: SimConfig, model: ModelSpec, device: DeviceSpec, train_gpus: int, longest: int = 0) -> TrainMemory:
    """Memory per GPU when sequences reach `longest` tokens (a micro-batch holds whole sequences)."""
    t = cfg.train
    lay = layout(cfg, model, device, train_gpus)
    per_param = BF16_BYTES + t.grad_bytes_per_param + t.optimizer_bytes_per_param
    per_param += BF16_BYTES if t.reference_model else 0  # the frozen reference, sharded the same way (assumption)
    # PyTorch FSDP holds the unit in use and the one it prefetches unsharded (Zhao et al. 2023, "PyTorch
    # FSDP", sec. 3.3-4.1); a unit is one layer here, its gradient unsharded until reduce-scattered.
    buffers = (2 * BF16_BYTES + t.grad_bytes_per_param) * gathered_layer_params(model, lay.ep) / lay.tp
    if t.fsdp_root_gathered:
        # The root unit (embeddings, lm_head, final norm: what no decoder layer holds) is gathered once for the
        # whole step, its gradient unsharded until the last reduce-scatter: FSDP2 does not reshard the root after
        # its forward when only the decoder layers are units of their own (the reference runtime's trainer). At
        # Qwen3's 151,936-token vocabulary that is most of a small model (measured: benchmarks/trainer_memory.py,
        # docs/training.md).
        buffers += (BF16_BYTES + t.grad_bytes_per_param) * root_params(model) / lay.tp
    buffers = buffers if lay.dp > 1 else 0.0
    if t.micro_batch_sequences is None:
        tokens = max(t.micro_batch_tokens, longest)
    else:  # a padded micro-batch of the longest sequences
        tokens = t.micro_batch_sequences * max(longest, 1)
    if t.activation_gb is None:
        act, estimated = activation_bytes(model, lay, t.activation_recompute, tokens, t.logit_chunk_tokens) / GB, True
    else:
        act, estimated = t.activation_gb, False
    return TrainMemory(per_param * model.params / train_gpus / GB, buffers / GB, act, tokens, estimated)


def root_params(model: ModelSpec) -> int:
    """Parameters outside the decoder layers: the embedding, an untied lm_head and the final norm."""
    return model.vocab * model.hidden * (1 if model.tie_embeddings else 2) + model.hidden


def gathered_layer_params(model: ModelSpec, ep: int) -> int:
    """Parameters of the largest layer one GPU gathers: a dense layer, or an MoE layer with the experts
    of its expert-parallel rank (all of them at ep = 1)."""
    if ep == 1:
        return model.layer_params
    moe = model.moe_layer_params - model.experts * model.expert_params * (ep - 1) // ep
    return max(model.dense_layer_params if model.dense_layers else 0, moe)


def check_fits(cfg: SimConfig, model: ModelSpec, device: DeviceSpec, train_gpus: int, longest: int) -> None:
    """UserError naming the layout key or the memory part that fails, and by how much."""
    lay = layout(cfg, model, device, train_gpus)
    mem = memory(cfg, model, device, train_gpus, longest)
    need, hbm = mem.total_gb, device.hbm_gb
    if need > hbm:
        raise UserError(
            f"{model.name} does not fit for training on {train_gpus} GPUs: needs {need:.1f} GB per GPU, "
            f"{need - hbm:.1f} GB more than the {hbm:.0f} GB of a {device.name}: {_what_fails(cfg, lay, mem, longest)}"
        )


def _what_fails(cfg: SimConfig, lay: Layout, mem: TrainMemory, longest: int) -> str:
    """The larger of the two parts that scale (state, activations) with its remedies, then the rest."""
    t = cfg.train
    state = (
        f"weights, gradients and optimizer state need {mem.state_gb:.1f} GB per GPU, ZeRO-3 sharded over all "
        f"{lay.tp * lay.pp * lay.dp} GPUs (tp={lay.tp} x pp={lay.pp} x dp={lay.dp})"
    )
    buffers = f"gather buffers {mem.buffers_gb:.1f} GB"
    if not mem.estimated:
        act = f"activations need {mem.activations_gb:.1f} GB per GPU (train.activation_gb)"
        remedies = ["lower train.activation_gb", "set it to null to estimate it from the layout"]
    else:
        act = (
            f"activations of a {mem.micro_batch_tokens}-token micro-batch need {mem.activations_gb:.1f} GB per GPU "
            f"with activation_recompute={t.activation_recompute}"
        )
        remedies = ["enable recompute (train.activation_recompute=full)"] if t.activation_recompute != "full" else []
        if t.micro_batch_sequences is not None:
            act += f" ({t.micro_batch_sequences} sequences padded to {longest} tokens)"
            remedies.append("lower train.micro_batch_sequences")
        elif mem.micro_batch_tokens > t.micro_batch_tokens:
            act += f" (a {longest}-token sequence is a micro-batch of its own)"
            remedies.append("lower the workload's maximum lengths")
        else:
            remedies.append("lower train.micro_batch_tokens")
        remedies.append("raise train.tensor_parallel")
    if mem.activations_gb <= mem.state_gb:
        return f"{state}; add train GPUs (also: {act}; {buffers})"
    return f"{act}; {', '.join(remedies[:-1])} or {remedies[-1]} (also: {state}; {buffers})"
