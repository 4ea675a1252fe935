"""Roofline cost model: seconds for prefill, decode, training, weight sync and role switches.

Every term is max(FLOPs / (peak x MFU), bytes / (bandwidth x efficiency)) plus a fixed overhead,
with the efficiencies read from the config. Decode is continuous batching: one step emits a token for
each of `b` running sequences, reads all weights once and every running sequence's KV cache. Within
a stretch where the batch does not change, contexts grow by one token a step, so the step time is a
max of two lines in the step index and `decode_run_s` sums it in closed form; this is what lets the
simulator jump from one request completion to the next instead of stepping every token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.errors import UserError
from core.specs import DeviceSpec, ModelSpec
from core.tags import Tag
from sim import train_layout
from sim.config import SimConfig

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


class CostModel:
    def __init__(self, cfg: SimConfig, model: ModelSpec, device: DeviceSpec) -> None:
        self.cfg, self.model, self.device = cfg, model, device
        c = cfg.costs
        self.tp = cfg.rollout.tensor_parallel
        self._hbm = self.tp * device.hbm_bandwidth_gb_s * GB * c.hbm_efficiency  # bytes/s per engine
        self._decode_flops = self.tp * device.peak_tflops * TFLOP * c.decode_mfu
        self._prefill_flops = self.tp * device.peak_tflops * TFLOP * c.prefill_mfu
        attn_flops_per_ctx = 4 * model.layers * model.attn_dim
        self._decode_k = (  # seconds per step: weights, per ctx token (KV), per sequence, per ctx token (attn)
            model.weight_bytes / self._hbm,
            model.kv_bytes_per_token / self._hbm,
            2 * model.matmul_params / self._decode_flops,
            attn_flops_per_ctx / self._decode_flops,
            c.decode_step_overhead_s,
        )

    # ---- inference ----

    def kv_capacity_tokens(self, train_gpus: int = 0) -> int:
        """KV-cache tokens one engine holds. On a train-capable resource the trainer's bf16 weight
        shard stays resident (its optimizer state is offloaded), which shrinks the cache."""
        r = self.cfg.rollout
        per_gpu = self.device.hbm_gb * GB * r.gpu_memory_utilization - r.workspace_gb * GB
        per_gpu -= self.model.weight_bytes / self.tp
        if train_gpus:
            per_gpu -= self.model.weight_bytes / train_gpus
        return max(0, int(per_gpu * self.tp // self.model.kv_bytes_per_token))

    def decode_lines(self, batch: int, sum_ctx: int) -> DecodeLines:
        k = self._decode_k
        return DecodeLines(
            p1=k[0] + k[1] * sum_ctx, q1=k[1] * batch, p2=k[2] * batch + k[3] * sum_ctx, q2=k[3] * batch, overhead=k[4]
        )

    def decode_step_s(self, batch: int, sum_ctx: int) -> float:
        return self.decode_run_s(batch, sum_ctx, 1)

    def decode_run_s(self, batch: int, sum_ctx: int, steps: int) -> float:
        """Seconds for `steps` decode steps of `batch` sequences whose contexts sum to `sum_ctx`.

        Hot path (called at every engine event): the lines of `decode_lines` are inlined."""
        if steps <= 0:
            return 0.0
        w, kv, mm, att, overhead = self._decode_k
        p1, q1 = w + kv * sum_ctx, kv * batch  # memory: weights + every KV cache, per step
        p2, q2 = mm * batch + att * sum_ctx, att * batch  # compute: matmuls + attention
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
        """Prefill `new_tokens` in one batch; `attn_pairs` = sum of query-key pairs attended."""
        if new_tokens <= 0:
            return 0.0
        m = self.model
        flops = 2 * m.matmul_params * new_tokens + 4 * m.layers * m.attn_dim * attn_pairs
        return max(flops / self._prefill_flops, m.weight_bytes / self._hbm)

    # ---- training ----

    def train_step_s(self, seq_lens: list[int], train_gpus: int) -> float:
        """One RL step's update over sequences of these lengths on `train_gpus` GPUs, in the layout of
        `train.*` (epochs, mini-batches, tp x pp x ZeRO-3 dp); parts in `train_layout.step`."""
        return train_layout.step(self.cfg, self.model, self.device, seq_lens, train_gpus).total_s

    def train_memory_gb(self, train_gpus: int, longest_tokens: int = 0) -> float:
        """Trainer memory per GPU when sequences reach `longest_tokens`; parts in `train_layout.memory`."""
        return train_layout.memory(self.cfg, self.model, self.device, train_gpus, longest_tokens).total_gb

    # ---- weight sync and role switches ----

    def sync_s(self, local: bool, targets: int) -> float:
        """Load new weights into engines: in-node resharding over NVLink when the resource trained
        them itself, otherwise a pipelined NCCL broadcast over the network to `targets` resources."""
        c, d = self.cfg.costs, self.device
        shard = self.model.weight_bytes / self.tp  # bytes each inference GPU receives
        if local:
            return shard / (d.nvlink_gb_s * GB * c.nvlink_efficiency) + c.sync_fixed_s
        hops = math.ceil(math.log2(targets + 1))
        return shard / (d.network_gb_s * GB * c.network_efficiency) + hops * c.broadcast_hop_s + c.sync_fixed_s

    def switch_s(self, to: Tag, train_gpus: int) -> float:
        """Change a resource's role: move its gradient and optimizer shard across PCIe (offload when
        going to rollout, onload when going to train), then wake or sleep the engine."""
        t, c = self.cfg.train, self.cfg.costs
        moved = (t.grad_bytes_per_param + t.optimizer_bytes_per_param) * self.model.params / train_gpus
        del to  # symmetric: the same bytes move each way
        return moved / (self.device.pcie_gb_s * GB * c.pcie_efficiency) + c.switch_fixed_s

    # ---- feasibility ----

    def check_fits(self, train_gpus: int, max_request_tokens: int, colocated: bool) -> None:
        """Raise UserError naming the constraint that fails and by how much."""
        d, r = self.device, self.cfg.rollout
        usable = d.hbm_gb * r.gpu_memory_utilization - r.workspace_gb
        weights = self.model.weight_bytes / self.tp / GB
        if weights >= usable:
            raise UserError(
                f"{self.model.name} does not fit for inference: {weights:.1f} GB of weights per GPU at "
                f"tensor_parallel={self.tp} exceed the {usable:.1f} GB usable on one {d.name} by "
                f"{weights - usable:.1f} GB; raise rollout.tensor_parallel"
            )
        capacity = self.kv_capacity_tokens(train_gpus if colocated else 0)
        if capacity < max_request_tokens:
            raise UserError(
                f"KV cache of one engine holds {capacity} tokens but a request can reach "
                f"{max_request_tokens} tokens (short by {max_request_tokens - capacity}); raise "
                "rollout.tensor_parallel or lower the workload's maximum lengths"
            )
        train_layout.check_fits(self.cfg, self.model, d, train_gpus, max_request_tokens)
