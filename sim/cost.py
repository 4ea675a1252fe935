"""Roofline cost model: seconds for prefill, decode, training, weight sync and role switches.

Every term is max(FLOPs / (peak x MFU), bytes / (bandwidth x efficiency)) plus a fixed overhead,
with the efficiencies read from the config. Decode is continuous batching: one step emits a token for
each of `b` running sequences, reads all weights once and every running sequence's KV cache. Within
a stretch where the batch does not change, contexts grow by one token a step, so the step time is a
max of two lines in the step index and `decode_run_s` sums it in closed form; this is what lets the
simulator jump from one request completion to the next instead of stepping every token.

A paged engine (sim/engine.py) mixes prefill chunks into decode steps; such a step costs
`prefill_s` of its chunk plus `decode_run_s` of one step of its decoding batch, which counts the
weights read twice where one fused pass reads them once (a few milliseconds a step).

Mixture-of-experts models: FLOPs come from the active parameters (`ModelSpec.matmul_params`), memory
and weight sync from all of them, and a forward pass over b tokens reads every dense weight plus, in
each MoE layer, only the routed experts those tokens use (`expected_experts`). The weight-read term
then depends on the batch alone, so it is still constant within a stretch and the closed form holds.
With `rollout.expert_parallel` = ep > 1 an engine spreads whole experts over ep of its GPUs and every
MoE layer sends each token's hidden state to its experts and back (an all-to-all dispatch and combine
over NVLink, `train_layout.alltoall_bytes`), added to every decode step and prefill, not overlapped. Its
weights per GPU and the bytes a step reads stay as they are (both layouts spread the experts over the
engine's GPUs), and so do the bytes a weight sync moves to each GPU. What expert parallelism saves inside
an engine (the MoE output's tensor-parallel all-reduce, small per-GPU expert matmuls) is not modelled:
decode has no tensor-parallel communication term to save.

Costs of an engine's own making, per layer so that one value describes every model of a device (all 0 by
default, the fused kernels, CUDA graphs and split-KV attention of vLLM; a plain-torch engine has them):
a decode step's small kernels (`decode_layer_overhead_s`, and per sequence `decode_seq_layer_overhead_s`),
an attention kernel that walks one sequence's cache without splitting it over the multiprocessors
(`decode_ctx_latency_s` a layer and context token of the step's mean sequence, whatever the batch), and
the host's launches of an eager prefill (`prefill_layer_host_s`), which overlap the device's work partly
(`train_layout.overlap`). Prefill attention may run at its own efficiency (`prefill_attention_mfu`).

The terms a cost model runs on are named records built once from the constants, the model and the device
(`CostTerms`: `decode`, `prefill`, `comm`); training and log-prob passes are priced by sim/train_layout.py,
whose `TrainStep` names each part of a step.

Calibration (`costs.profile`, sim/calibration.py) runs first: it fits the constants to a measured profile
of the device (every model it measured at once) and hands them to the cost model (`CostModel(...,
costs=)`; `sim.calibration.calibrated_cost_model` does both). A cost model never calibrates itself.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from core.errors import UserError
from core.specs import DeviceSpec, ModelSpec
from core.tags import Tag
from sim import train_layout
from sim.config import CostConfig, SimConfig
from sim.train_layout import Flops

GB = 1e9
TFLOP = 1e12


@dataclass(frozen=True)
class DecodeLines:
    """Step j of a stretch costs max(p1 + q1*j, p2 + q2*j) + overhead seconds (memory, compute)."""

    p1: float
    q1: float
    p2: float
    q2: float
    overhead: float


def _sum_line(p: float, q: float, lo: int, hi: int) -> float:
    """sum_{j=lo}^{hi-1} (p + q*j)."""
    n = hi - lo
    return n * p + q * (lo + hi - 1) * n / 2 if n > 0 else 0.0


def expected_experts(experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts of one MoE layer that `tokens` tokens use, `per_token` each:
    E x (1 - (1 - k/E)^b).

    Assumption: uniform, independent routing. Each token picks k distinct experts of E uniformly, so
    one token misses a given expert with probability 1 - k/E and b tokens with (1 - k/E)^b. That is k
    at b = 1 and nearly E at large b. Trained routers are imbalanced, which leaves fewer experts
    distinct at a given batch, so this is an upper bound on the experts (and bytes) a step reads."""
    return experts * (1.0 - (1.0 - per_token / experts) ** tokens)


@dataclass(frozen=True, slots=True)
class DecodeTerms:
    """One decode step's seconds, term by term, on one engine (`CostModel.decode_run_s` sums them over a stretch)."""

    weight_bytes_per_s: float  # the engine's HBM reading weights (costs.hbm_efficiency)
    weights_s: float  # reading every weight once: a dense model's step (an MoE model reads what its batch routes to)
    kv_s_per_token: float  # reading one context token's KV cache (costs.kv_hbm_efficiency, else hbm_efficiency)
    matmul_s_per_seq: float  # one sequence's matmuls (an MoE model's active parameters), at decode_mfu
    attention_s_per_token: float  # attention's FLOPs per context token, at decode_mfu
    step_overhead_s: float  # the step's fixed cost: decode_step_overhead_s + layers x decode_layer_overhead_s
    seq_overhead_s: float  # per sequence: decode_seq_overhead_s + layers x decode_seq_layer_overhead_s
    walk_s_per_token: float  # attention's walk over the mean sequence's cache: layers x decode_ctx_latency_s


@dataclass(frozen=True, slots=True)
class PrefillTerms:
    """One prefill's rates and fixed seconds on one engine (`CostModel.prefill_s`)."""

    matmul_flops_per_s: float  # at prefill_mfu, over the engine's GPUs
    attention_flops_per_s: float  # at prefill_attention_mfu (prefill_mfu where null)
    weight_bytes_per_s: float  # the engine's HBM reading weights (costs.hbm_efficiency)
    host_s: float  # the host's launches of one eager forward: layers x prefill_layer_host_s
    overhead_s: float  # an engine's fixed cost of a step that prefills (costs.prefill_overhead_s)


@dataclass(frozen=True, slots=True)
class CommTerms:
    """Links between GPUs and to the host, and the fixed seconds of syncs, switches and all-to-alls."""

    nvlink_bytes_per_s: float  # one GPU's NVLink (costs.nvlink_efficiency)
    network_efficiency: float  # of the slower NIC of a sync's two devices (known per sync: `CostModel.sync_s`)
    pcie_bytes_per_s: float  # one GPU's PCIe to the host (costs.pcie_efficiency)
    alltoall_latency_s: float  # fixed seconds of one all-to-all (MoE expert parallelism)
    broadcast_hop_s: float  # fixed seconds of each hop of a pipelined broadcast
    sync_fixed_s: float  # of every weight sync
    switch_fixed_s: float  # of every role switch (waking or sleeping an engine)


@dataclass(frozen=True, slots=True)
class CostTerms:
    """What a cost model prices with: its constants applied to one model on one device, by part."""

    decode: DecodeTerms
    prefill: PrefillTerms
    comm: CommTerms

    @classmethod
    def of(cls, costs: CostConfig, model: ModelSpec, device: DeviceSpec, tp: int) -> CostTerms:
        """The terms of an engine of `tp` GPUs of `device` running `model` at the constants `costs`."""
        c, layers = costs, model.layers
        hbm = tp * device.hbm_bandwidth_gb_s * GB * c.hbm_efficiency  # bytes/s per engine
        kv_hbm = hbm if c.kv_hbm_efficiency is None else tp * device.hbm_bandwidth_gb_s * GB * c.kv_hbm_efficiency
        decode_flops = tp * device.peak_tflops * TFLOP * c.decode_mfu
        attention_mfu = c.prefill_mfu if c.prefill_attention_mfu is None else c.prefill_attention_mfu
        decode = DecodeTerms(
            weight_bytes_per_s=hbm,
            weights_s=model.weight_bytes / hbm,
            kv_s_per_token=model.kv_bytes_per_token / kv_hbm,
            matmul_s_per_seq=2 * model.matmul_params / decode_flops,
            attention_s_per_token=4 * layers * model.attn_dim / decode_flops,
            step_overhead_s=c.decode_step_overhead_s + layers * c.decode_layer_overhead_s,
            seq_overhead_s=c.decode_seq_overhead_s + layers * c.decode_seq_layer_overhead_s,
            walk_s_per_token=layers * c.decode_ctx_latency_s,
        )
        prefill = PrefillTerms(
            matmul_flops_per_s=tp * device.peak_tflops * TFLOP * c.prefill_mfu,
            attention_flops_per_s=tp * device.peak_tflops * TFLOP * attention_mfu,
            weight_bytes_per_s=hbm,
            host_s=layers * c.prefill_layer_host_s,
            overhead_s=c.prefill_overhead_s,
        )
        comm = CommTerms(
            nvlink_bytes_per_s=device.nvlink_gb_s * GB * c.nvlink_efficiency,
            network_efficiency=c.network_efficiency,
            pcie_bytes_per_s=device.pcie_gb_s * GB * c.pcie_efficiency,
            alltoall_latency_s=c.alltoall_latency_s,
            broadcast_hop_s=c.broadcast_hop_s,
            sync_fixed_s=c.sync_fixed_s,
            switch_fixed_s=c.switch_fixed_s,
        )
        return cls(decode, prefill, comm)


class CostModel:
    """Seconds of an engine's, a trainer's and a sync's work on one device. `costs`: the constants it runs on,
    a calibration's (`sim.calibration.calibrated_cost_model`); None: `cfg.costs`, which then must not name a
    profile (its constants would be silently left uncalibrated)."""

    def __init__(self, cfg: SimConfig, model: ModelSpec, device: DeviceSpec, costs: CostConfig | None = None) -> None:
        if costs is None and cfg.costs.profile is not None:
            raise ValueError(
                f"costs.profile={cfg.costs.profile!r} is set but no calibrated constants were given: build the cost "
                "model with sim.calibration.calibrated_cost_model, or pass the constants as `costs`"
            )
        if costs is not None and costs is not cfg.costs:
            cfg = dataclasses.replace(cfg, costs=costs)
        self.cfg, self.model, self.device = cfg, model, device
        self.tp = cfg.rollout.tensor_parallel
        self.terms = CostTerms.of(cfg.costs, model, device, self.tp)
        self._decode = self.terms.decode  # read at every engine event
        self.prefill_overhead_s = self.terms.prefill.overhead_s  # read at every prefill
        self._is_moe = model.is_moe
        self._moe_weights_s: dict[int, float] = {}  # MoE: decode batch -> seconds to read its weights
        self._ep = cfg.rollout.expert_parallel  # > 1: all-to-alls in every forward (MoE only)

    # ---- inference ----

    def weight_bytes_read(self, tokens: int) -> float:
        """Bytes of weights one forward pass over `tokens` tokens reads: every weight of a dense model;
        of an MoE model every dense weight and, in each MoE layer, the routed experts the tokens use
        (`expected_experts`), spread over the engine's GPUs with or without expert parallelism."""
        m = self.model
        if not m.is_moe:
            return m.weight_bytes
        unused = m.experts - expected_experts(m.experts, m.experts_per_token, tokens)
        return m.weight_bytes - m.moe_layers * m.routed_expert_bytes * unused

    def decode_weights_s(self, batch: int) -> float:
        """Seconds one decode step of `batch` sequences spends reading weights (cached per batch)."""
        if not self._is_moe:
            return self._decode.weights_s
        seconds = self._moe_weights_s.get(batch)
        if seconds is None:
            seconds = self._moe_weights_s[batch] = self.weight_bytes_read(batch) / self._decode.weight_bytes_per_s
        return seconds

    def kv_capacity_tokens(self, train_gpus: int = 0) -> int:
        """KV-cache tokens one engine holds, beside all its weights (every expert of an MoE model).
        On a train-capable resource the trainer's bf16 weight shard stays resident (its optimizer
        state is offloaded), which shrinks the cache."""
        r = self.cfg.rollout
        per_gpu = self.device.hbm_gb * GB * r.gpu_memory_utilization - r.workspace_gb * GB
        per_gpu -= self.model.weight_bytes / self.tp
        if train_gpus:
            per_gpu -= self.model.weight_bytes / train_gpus
        return max(0, int(per_gpu * self.tp // self.model.kv_bytes_per_token))

    def alltoall_s(self, tokens: int) -> float:
        """Seconds of the all-to-alls of one forward over `tokens` tokens: a dispatch and a combine per MoE
        layer, each GPU sending the hidden states of its 1/tp of the tokens over NVLink; 0 at ep = 1."""
        if self._ep == 1:
            return 0.0
        comm = self.terms.comm
        sent = train_layout.alltoall_bytes(self.model, tokens / self.tp, self._ep)
        return self.model.moe_layers * 2 * (sent / comm.nvlink_bytes_per_s + comm.alltoall_latency_s)

    def decode_lines(self, batch: int, sum_ctx: int) -> DecodeLines:
        """The two lines of a stretch. The attention's walk over the mean sequence's cache (costs.
        decode_ctx_latency_s) is added to both: it grows by one context token a step, like the lines."""
        d, w = self._decode, self.decode_weights_s(batch)
        overhead = d.step_overhead_s + d.seq_overhead_s * batch
        if self._ep > 1:
            overhead += self.alltoall_s(batch)
        walk, grow = (d.walk_s_per_token * sum_ctx / batch, d.walk_s_per_token) if batch else (0.0, 0.0)
        return DecodeLines(
            p1=w + d.kv_s_per_token * sum_ctx + walk,
            q1=d.kv_s_per_token * batch + grow,
            p2=d.matmul_s_per_seq * batch + d.attention_s_per_token * sum_ctx + walk,
            q2=d.attention_s_per_token * batch + grow,
            overhead=overhead,
        )

    def decode_step_s(self, batch: int, sum_ctx: int) -> float:
        return self.decode_run_s(batch, sum_ctx, 1)

    def decode_run_s(self, batch: int, sum_ctx: int, steps: int) -> float:
        """Seconds for `steps` decode steps of `batch` sequences whose contexts sum to `sum_ctx`.

        Hot path (called at every engine event): the lines of `decode_lines` are inlined."""
        if steps <= 0:
            return 0.0
        d = self._decode
        kv, mm, att, overhead, per_seq, walk = (
            d.kv_s_per_token,
            d.matmul_s_per_seq,
            d.attention_s_per_token,
            d.step_overhead_s,
            d.seq_overhead_s,
            d.walk_s_per_token,
        )
        if per_seq:
            overhead += per_seq * batch
        # the experts an MoE model's step reads depend on the batch, fixed within the stretch
        w = self.decode_weights_s(batch) if self._is_moe else d.weights_s
        p1, q1 = w + kv * sum_ctx, kv * batch  # memory: weights + every KV cache, per step
        p2, q2 = mm * batch + att * sum_ctx, att * batch  # compute: matmuls + attention
        if walk and batch:  # the attention's walk over the mean sequence's cache, on both lines (see decode_lines)
            p1, q1, p2, q2 = p1 + walk * sum_ctx / batch, q1 + walk, p2 + walk * sum_ctx / batch, q2 + walk
        # The memory line wins from step `cross` on when it grows faster, the compute line otherwise.
        if q1 == q2:
            cross = 0 if p1 >= p2 else steps
            first, second = (p2, q2), (p1, q1)
        elif q1 > q2:
            cross = min(steps, max(0, math.ceil((p2 - p1) / (q1 - q2))))
            first, second = (p2, q2), (p1, q1)
        else:
            cross = min(steps, max(0, math.ceil((p1 - p2) / (q2 - q1))))
            first, second = (p1, q1), (p2, q2)
        if self._ep > 1:  # the batch's all-to-alls, the same every step of the stretch
            overhead += self.alltoall_s(batch)
        return _sum_line(*first, 0, cross) + _sum_line(*second, cross, steps) + steps * overhead

    def decode_steps_within(self, batch: int, sum_ctx: int, budget_s: float, limit: int) -> int:
        """Largest m <= limit with decode_run_s(batch, sum_ctx, m) <= budget_s.

        Steps only get slower within a stretch, so budget / (first step) bounds m from above and
        is usually within a step or two of it; a binary search below that bound finishes the job."""
        if budget_s <= 0 or limit <= 0:
            return 0
        run = self.decode_run_s
        tol = budget_s + 1e-12
        hi = min(limit, int(budget_s / run(batch, sum_ctx, 1)))
        for m in (hi, hi - 1):
            if m <= 0:
                return 0
            if run(batch, sum_ctx, m) <= tol:
                return m
        lo, hi = 0, hi - 2
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if run(batch, sum_ctx, mid) <= tol:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def prefill_s(self, new_tokens: int, attn_pairs: float) -> float:
        """Prefill `new_tokens` in one batch; `attn_pairs` = sum of query-key pairs attended. An MoE
        model computes with its active parameters and reads the experts its `new_tokens` tokens use."""
        if new_tokens <= 0:
            return 0.0
        p = self.terms.prefill
        flops = self.prefill_flops(new_tokens, attn_pairs)
        # The device's work: the matmuls at prefill_mfu and attention at prefill_attention_mfu, or the weight reads
        # at hbm_efficiency, whichever is longer; the host's launches (prefill_layer_host_s) overlap it partly.
        compute = flops.matmul / p.matmul_flops_per_s + flops.attention / p.attention_flops_per_s
        memory = self.weight_bytes_read(new_tokens) / p.weight_bytes_per_s
        seconds = train_layout.overlap(max(compute, memory), p.host_s)
        return seconds + self.alltoall_s(new_tokens) if self._ep > 1 else seconds

    def prefill_flops(self, new_tokens: int, attn_pairs: float) -> Flops:
        """FLOPs of a prefill: the matmuls' of every new token, QK^T and AV of every pair."""
        m = self.model
        return Flops(matmul=2 * m.matmul_params * new_tokens, attention=4 * m.layers * m.attn_dim * attn_pairs)

    # ---- training ----

    def train_step_s(self, seq_lens: list[int], train_gpus: int) -> float:
        """One RL step's update over sequences of these lengths on `train_gpus` GPUs, in the layout of
        `train.*` (epochs, mini-batches, tp x pp x ZeRO-3 dp); parts in `train_layout.step`."""
        return train_layout.step(self.cfg, self.model, self.device, seq_lens, train_gpus).total_s

    def train_memory_gb(self, train_gpus: int, longest_tokens: int = 0) -> float:
        """Trainer memory per GPU when sequences reach `longest_tokens`; parts in `train_layout.memory`."""
        return train_layout.memory(self.cfg, self.model, self.device, train_gpus, longest_tokens).total_gb

    # ---- weight sync and role switches ----

    def sync_s(self, local: bool, targets: int, receiver: DeviceSpec | None = None) -> float:
        """Load new weights into engines: in-node resharding over NVLink when the resource trained
        them itself, otherwise a pipelined NCCL broadcast over the network from this model's device
        to `targets` resources of the `receiver` device (this one if None), at the slower NIC of the two.

        Every parameter moves, all experts of an MoE model. Each GPU receives weight_bytes / tp: its
        slice of every expert (vLLM's default), or with rollout.expert_parallel = ep its E/ep whole experts
        sliced over tp/ep GPUs, the same bytes."""
        comm, d = self.terms.comm, self.device
        shard = self.model.weight_bytes / self.tp  # bytes each inference GPU receives
        if local:
            return shard / comm.nvlink_bytes_per_s + comm.sync_fixed_s
        hops = math.ceil(math.log2(targets + 1))
        network_gb_s = min(d.network_gb_s, (receiver or d).network_gb_s)
        network = network_gb_s * GB * comm.network_efficiency
        return shard / network + hops * comm.broadcast_hop_s + comm.sync_fixed_s

    def switch_s(self, to: Tag, train_gpus: int) -> float:
        """Change a resource's role: move its gradient and optimizer shard across PCIe (offload when
        going to rollout, onload when going to train), then wake or sleep the engine."""
        t, comm = self.cfg.train, self.terms.comm
        moved = (t.grad_bytes_per_param + t.optimizer_bytes_per_param) * self.model.params / train_gpus
        del to  # symmetric: the same bytes move each way
        return moved / comm.pcie_bytes_per_s + comm.switch_fixed_s

    # ---- feasibility ----

    def check_fits(self, train_gpus: int, max_request_tokens: int, colocated: bool) -> None:
        """Raise UserError naming the constraint that fails and by how much: engines on this device
        (beside a resident weight shard when `colocated`), then the trainer on it."""
        self.check_engine_fits(max_request_tokens, train_gpus if colocated else 0)
        self.check_train_fits(train_gpus, max_request_tokens)

    def check_engine_fits(self, max_request_tokens: int, train_gpus: int = 0) -> None:
        """An engine on this device holds the weights and the longest request's KV cache (beside the
        trainer's weight shard of `train_gpus` GPUs on a train-capable resource); UserError if not."""
        d, r = self.device, self.cfg.rollout
        usable = d.hbm_gb * r.gpu_memory_utilization - r.workspace_gb
        weights = self.model.weight_bytes / self.tp / GB
        if weights >= usable:
            every = f" (all {self.model.experts} experts a layer)" if self.model.is_moe else ""
            raise UserError(
                f"{self.model.name} does not fit for inference: {weights:.1f} GB of weights{every} per GPU at "
                f"tensor_parallel={self.tp} exceed the {usable:.1f} GB usable on one {d.name} by "
                f"{weights - usable:.1f} GB; raise rollout.tensor_parallel"
            )
        capacity = self.kv_capacity_tokens(train_gpus)
        if capacity < max_request_tokens:
            shard = self.model.weight_bytes / train_gpus / GB if train_gpus else 0.0
            beside = f" beside the trainer's resident {shard:.1f} GB weight shard per GPU" if shard else ""
            on = f" on {d.name}" if self.cfg.cluster.rollout_pool is not None else ""  # which of two devices
            raise UserError(
                f"KV cache of one engine{on} holds {capacity} tokens{beside} but a request can reach "
                f"{max_request_tokens} tokens (short by {max_request_tokens - capacity}); raise "
                f"rollout.tensor_parallel{' or cluster.num_gpus' if shard else ''} or lower the workload's "
                "maximum lengths"
            )

    def check_train_fits(self, train_gpus: int, longest: int) -> None:
        """The trainer fits on `train_gpus` GPUs of this device with sequences of `longest` tokens."""
        train_layout.check_fits(self.cfg, self.model, self.device, train_gpus, longest)
