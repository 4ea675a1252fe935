"""The simulator's config: one frozen dataclass per component, loaded from YAML.

`load_config` starts from `configs/default.yaml` (the documented paper-like setup: Qwen3-32B, math,
64 H800 GPUs), merges the defaults of a chosen kind (`workload.kind: swe` brings `configs/swe.yaml`), then the
user's files in order (later ones win key by key), then dotted `--set` overrides. Every physical constant
and efficiency lives in those files.

A cluster is one device type (`cluster.device`), or two: with `cluster.rollout_pool` set,
`cluster.device` x `cluster.num_gpus` are the train-capable GPUs and the rollout pool's GPUs,
possibly of another type, only generate (configs/hetero.yaml).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from core import config as cfgio
from core import specs
from core.errors import UserError
from core.policies.settings import PolicySettings
from sim import profile as profiles

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
WORKLOADS = ("math", "swe")


@dataclass(frozen=True)
class Dist:
    """A capped log-normal: median * exp(sigma * N(0, 1)), clipped to [min, max]. sigma 0 = constant."""

    median: float
    sigma: float
    min: float
    max: float

    def validate(self, path: str) -> None:
        if self.median <= 0 or self.sigma < 0 or not 0 <= self.min <= self.median <= self.max:
            raise UserError(f"{path} needs median > 0, sigma >= 0 and 0 <= min <= median <= max, got {self}")


@dataclass(frozen=True)
class RolloutPoolConfig:
    """Rollout-only GPUs beside the train-capable ones, of their own device type (a heterogeneous cluster)."""

    device: str  # as cluster.device
    num_gpus: int
    price_per_gpu_hour: float | None  # as cluster.price_per_gpu_hour; set both or neither
    max_num_seqs: int | None  # requests one of these engines runs at once (null: rollout.max_num_seqs). A slower
    # device given fewer holds fewer requests back from faster engines that run dry


@dataclass(frozen=True)
class ClusterConfig:
    device: str  # a shipped device (core/specs/devices.yaml) or a path to a YAML file with the same fields
    num_gpus: int  # with rollout_pool: the train-capable GPUs only
    price_per_gpu_hour: float | None  # the user's price of one GPU for an hour, any currency (null: no cost figure)
    rollout_pool: RolloutPoolConfig | None  # null: one device type, split by pools.train_fraction; set: these
    # GPUs only generate and cluster.device x num_gpus is the train pool (pools.train_fraction unused)
    host_cores: int | None = None  # null: the host's own work (the trajectory and rollout managers, the driver)
    # never slows a device (GPU nodes have cores to spare). A number: the devices ARE the host's CPU cores (the
    # runtime on a CPU), and this many more cores are left to the host; its work (costs.host_token_s) runs on
    # those and on idle devices first and takes the rest from busy ones (sim/host.py)


@dataclass(frozen=True)
class PoolsConfig:
    """How disaggregated policies split resources (colocated ignores it, and so does a cluster with a
    rollout_pool: its devices make the split)."""

    train_fraction: float


KV_ALLOCATIONS = ("paged", "reserve")


@dataclass(frozen=True)
class RolloutConfig:
    """One inference engine per resource, scheduled like vLLM (sim/engine.py)."""

    tensor_parallel: int  # GPUs per inference engine; one engine per resource
    gpu_memory_utilization: float
    max_num_seqs: int  # requests an engine runs at once (and the router sends it at most)
    workspace_gb: float  # per GPU, kept free for activations and CUDA graphs
    kv_allocation: str = "paged"  # paged: KV blocks as tokens arrive, preemption by recompute (vLLM,
    # SGLang) | reserve: admission reserves each request's final length (an oracle; no preemption)
    kv_block_tokens: int = 16  # paged: tokens per KV block (vLLM's default block size)
    max_num_batched_tokens: int = 8192  # paged: tokens one engine step computes, decode tokens (one
    # per running sequence) first, then chunks of prefill
    prefix_caching: bool = False  # paged: a GRPO group's samples on one engine share their prompt's
    # KV blocks (default.yaml says why it is off)
    expert_parallel: int = 1  # MoE: an engine's GPUs its routed experts are spread over, whole experts
    # each (vLLM --enable-expert-parallel), tokens sent to them by all-to-all; 1: every expert tensor-parallel
    affinity_slack: int | None = None  # null: each request to the engine that ran the sample's previous turn if
    # it fits, else an idle engine, else round robin. An integer k: as the runtime's trajectory manager routes
    # (reference/manager/router.py), the least loaded engine (requests sent to it and not finished), a group's
    # requests kept on the engine of its last one while that holds at most k more than the least loaded
    max_concurrency: int | None = None  # null: every submitted group's samples at once. An integer n: as the
    # runtime's rollout manager (rollout.max_concurrency), groups run in n // group_size slots, the rest wait in
    # order, a finished group sent back into flight (streaming's refresh) waiting for a slot as a new one

    def validate(self) -> None:
        slack = self.affinity_slack
        if slack is not None and (not isinstance(slack, int) or isinstance(slack, bool) or slack < 0):
            raise UserError(f"rollout.affinity_slack must be null or an integer >= 0, got {slack!r}")
        cap = self.max_concurrency
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise UserError(f"rollout.max_concurrency must be null or an integer >= 1, got {cap!r}")
        if self.kv_allocation not in KV_ALLOCATIONS:
            mode, choices = self.kv_allocation, ", ".join(KV_ALLOCATIONS)
            raise UserError(f"unknown rollout.kv_allocation {mode!r}; valid choices: {choices}")
        if self.kv_block_tokens < 1:
            raise UserError(f"rollout.kv_block_tokens must be >= 1, got {self.kv_block_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise UserError(
                f"rollout.max_num_batched_tokens={self.max_num_batched_tokens} must be >= rollout.max_num_seqs="
                f"{self.max_num_seqs}: every running sequence decodes one token of a step's budget"
            )


RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class TrainConfig:
    """The trainer: its state's precision, its batch schedule and its parallel layout (sim/train_layout.py)."""

    grad_bytes_per_param: int  # also the dtype of the ZeRO-3 gradient reduce-scatter
    optimizer_bytes_per_param: int  # fp32 master weights + Adam moments
    recompute_logprobs: bool  # forward pass of the behaviour policy before the update
    reference_model: bool  # forward pass of a frozen reference for a KL term
    mini_batches: int  # optimizer steps per pass over the batch (the batch split into equal-token parts)
    ppo_epochs: int  # passes over the batch per RL step
    tensor_parallel: int  # GPUs splitting each layer's matmuls, within one node
    pipeline_parallel: int  # 1F1B pipeline stages; data parallel (ZeRO-3) = train GPUs / (tp x pp)
    micro_batch_tokens: int  # per micro-batch and data-parallel replica; a longer sequence is one on its own
    activation_recompute: str  # none | selective (attention core, norms) | full (each layer from its input)
    activation_gb: float | None  # per GPU: overrides the estimate from the model shape (null: estimate)
    expert_parallel: int = 1  # MoE: data-parallel replicas the routed experts are sharded over (ZeRO-3
    # over the rest), tokens sent to them by all-to-all; must divide data parallel (sim/train_layout.py)
    micro_batch_sequences: int | None = None  # padded micro-batches of this many sequences, each padded to
    # its longest (null: sequences packed into micro_batch_tokens, no padding); sim/train_layout.py
    zero_advantage_share: float = 0.0  # samples with no gradient (advantage 0), run forward only in the first
    # pass and skipped in later ones, as a trainer without KL or entropy terms does; 0: every sample trained
    fsdp_root_gathered: bool = False  # the root unit (embeddings, lm_head) stays gathered for the whole step, as
    # FSDP2 keeps it when only decoder layers are units of their own (false: a trainer that shards them too)
    logit_chunk_tokens: int | None = None  # the loss projects onto the vocabulary this many tokens at a time,
    # in fp32 (null: one bf16 copy of every token's logits, a fused log-prob kernel); sim/train_layout.py

    def validate(self, gpus_per_node: int, samples_per_step: int) -> None:
        keys = (
            "mini_batches",
            "ppo_epochs",
            "tensor_parallel",
            "pipeline_parallel",
            "micro_batch_tokens",
            "expert_parallel",
        )
        for key in keys:
            if getattr(self, key) < 1:
                raise UserError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        if self.activation_recompute not in RECOMPUTE:
            mode, choices = self.activation_recompute, ", ".join(RECOMPUTE)
            raise UserError(f"unknown train.activation_recompute {mode!r}; valid choices: {choices}")
        if self.activation_gb is not None and self.activation_gb < 0:
            raise UserError(f"train.activation_gb must be >= 0 or null, got {self.activation_gb}")
        share = self.zero_advantage_share
        if not (isinstance(share, int | float) and not isinstance(share, bool) and 0.0 <= share <= 1.0):
            raise UserError(f"train.zero_advantage_share must be a fraction in [0, 1], got {share!r}")
        if not isinstance(self.fsdp_root_gathered, bool):
            raise UserError(f"train.fsdp_root_gathered must be true or false, got {self.fsdp_root_gathered!r}")
        chunk = self.logit_chunk_tokens
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise UserError(
                f"train.logit_chunk_tokens must be null (every token's logits at once) or an integer "
                f">= 1, got {chunk!r}"
            )
        n = self.micro_batch_sequences
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise UserError(
                f"train.micro_batch_sequences must be null (packed micro-batches) or an integer >= 1, got {n!r}"
            )
        tp = self.tensor_parallel
        if tp > gpus_per_node or gpus_per_node % tp:
            raise UserError(
                f"train.tensor_parallel={tp} must divide the {gpus_per_node} GPUs of a node: tensor-parallel "
                "all-reduces run over NVLink, within one node"
            )
        if self.mini_batches > samples_per_step:
            raise UserError(
                f"train.mini_batches={self.mini_batches} exceeds the {samples_per_step} samples of a step "
                "(workload.prompts_per_step x workload.group_size)"
            )


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str
    prompts_per_step: int
    group_size: int
    prompt_tokens: Dist
    response_tokens: Dist  # math: the whole answer; swe: one turn's reply
    turns: Dist  # swe: agent turns per episode
    tool_output_tokens: Dist  # swe: tokens a tool call appends to the context
    tool_latency_s: Dist  # swe: sandbox time per tool call
    test_run_s: Dist  # swe: the final test run that computes the reward
    prefix_cache_hit: float  # swe: fraction of a returning turn's history found in the engine's cache
    max_context_tokens: int  # swe: an episode ends when its context would exceed this
    shared_response: bool = False  # math: a group's samples share one response length (the runtime's
    # `throughput` task forces one length per problem); a restarted sample keeps it
    sandbox_start_s: Dist | None = None  # swe: a container's start (null: none modelled). Each episode starts its
    # workspace when it starts (its first tool call waits for it) and a grader's before its test run
    sandbox_start_slots: int = 1  # swe: container starts under way at once; the rest queue in order
    sandbox_cpu_cores: float | None = None  # swe, with cluster.host_cores set: cores of CPU a sandbox's work uses
    # while it runs alone (the Docker daemon, the container's processes and the client); the sandboxes at work
    # share what the host's cores have left (sim/host.py), so many at once each take longer. null: not modelled
    sandbox_busy_stretch: float = 1.0  # swe, with cluster.host_cores set (devices that are the host's own cores):
    # how many times longer a sandbox's work (a tool call, a test run, a container's start) takes while every core
    # is busy, the daemon and the containers then sharing the cores with the devices' processes; with B of C cores
    # busy, 1 + (stretch - 1) x B / C. 1: no such effect (a GPU cluster's sandboxes run on CPUs of their own)


@dataclass(frozen=True)
class CostConfig:
    """Achieved fractions of the device peaks, and fixed overheads (seconds)."""

    prefill_mfu: float
    decode_mfu: float
    hbm_efficiency: float
    decode_step_overhead_s: float
    train_mfu: float
    logprob_mfu: float
    train_step_overhead_s: float
    nvlink_efficiency: float
    network_efficiency: float
    pcie_efficiency: float
    sync_fixed_s: float
    broadcast_hop_s: float
    switch_fixed_s: float
    alltoall_latency_s: float = 2e-5  # MoE expert parallelism: fixed seconds of one all-to-all
    decode_seq_overhead_s: float = 0.0  # per sequence in a decode step (sampling, scheduling, streaming)
    prefill_overhead_s: float = 0.0  # an engine's fixed time of a step that prefills (set-up, first tokens out)
    kv_hbm_efficiency: float | None = None  # decode's KV-cache reads (attention); null: hbm_efficiency's
    # Per-layer costs (seconds a layer, so one set of values describes every model on a device; sim/cost.py):
    decode_layer_overhead_s: float = 0.0  # a decode step's small kernels and the gaps between them, per layer
    decode_seq_layer_overhead_s: float = 0.0  # the same per sequence of the step
    decode_ctx_latency_s: float = 0.0  # decode attention's walk over one sequence's cache, per context token
    # (of the step's mean sequence) and layer: an attention kernel that does not split the cache
    prefill_attention_mfu: float | None = None  # prefill attention's (QK^T, AV) share of peak; null: prefill_mfu
    logprob_attention_mfu: float | None = None  # the same in log-prob passes; null: logprob_mfu
    train_attention_mfu: float | None = None  # the same in training's forward and backward; null: train_mfu
    prefill_layer_host_s: float = 0.0  # the host's time to launch one layer of an eager prefill forward
    logprob_layer_host_s: float = 0.0  # ... of an eager log-prob forward
    train_layer_host_s: float = 0.0  # ... of an eager forward + backward (one micro-batch)
    train_dp_overhead_s: float = 0.0  # a data-parallel step's own cost beyond its share of the work (the
    # collectives' floor, ranks waiting for the slowest), once an RL step when the trainer has dp > 1
    host_token_s: float = 0.0  # CPU-seconds of the host's work a generated token (streaming it through the
    # trajectory manager, the rollout manager's bookkeeping and grading); used only with cluster.host_cores
    sync_busy_s: float = 0.0  # a weight sync's extra seconds when an engine it pauses is generating: the pause
    # waits for the engine's step to end and for the host's event loop, busy streaming every request's tokens
    host_train_placement: float = 0.5  # of the host's work that spills onto busy cores, the parts a training
    # core takes for each 1 - this a rollout or syncing core takes (0.5: an even spread; sim/host.py)
    profile: str | None = None  # a measured profile (sim/profile.py) whose points set the efficiencies
    # above for the run's model on cluster.device (sim/calibration.py); a shipped name or a path; null: as set


@dataclass(frozen=True)
class SimConfig:
    seed: int
    num_steps: int
    model: str  # a shipped model (core/specs/models.yaml) or a path to a Hugging Face config.json (or its folder)
    cluster: ClusterConfig
    pools: PoolsConfig
    rollout: RolloutConfig
    train: TrainConfig
    workload: WorkloadConfig
    policy: PolicySettings  # core/policies/settings.py: the scheduling policy's knobs, one class for both executors
    costs: CostConfig

    def __post_init__(self) -> None:
        model = _spec("model", specs.model, self.model)
        dev = _spec("cluster.device", specs.device, self.cluster.device)
        if self.workload.kind not in WORKLOADS:
            raise UserError(f"unknown workload {self.workload.kind!r}; valid choices: {', '.join(WORKLOADS)}")
        self._check_positive()
        self.rollout.validate()
        self._check_pool("cluster", dev, self.cluster.num_gpus, self.cluster.price_per_gpu_hour)
        pool = self.cluster.rollout_pool
        if pool is not None:
            pool_dev = _spec("cluster.rollout_pool.device", specs.device, pool.device)
            self._check_pool("cluster.rollout_pool", pool_dev, pool.num_gpus, pool.price_per_gpu_hour)
            seqs, budget = pool.max_num_seqs, self.rollout.max_num_batched_tokens
            if seqs is not None and not 1 <= seqs <= budget:
                raise UserError(
                    f"cluster.rollout_pool.max_num_seqs must be null or in [1, rollout.max_num_batched_tokens={budget}]"
                    f", got {seqs}"
                )
            if (self.cluster.price_per_gpu_hour is None) != (pool.price_per_gpu_hour is None):
                raise UserError(
                    "cluster.price_per_gpu_hour and cluster.rollout_pool.price_per_gpu_hour must both be set "
                    f"or both be null, got {self.cluster.price_per_gpu_hour} and {pool.price_per_gpu_hour}"
                )
        for name in ("prompt_tokens", "response_tokens", "turns", "tool_output_tokens", "tool_latency_s", "test_run_s"):
            getattr(self.workload, name).validate(f"workload.{name}")
        if self.workload.sandbox_start_s is not None:
            self.workload.sandbox_start_s.validate("workload.sandbox_start_s")
        cpu = self.workload.sandbox_cpu_cores
        if cpu is not None and not (
            isinstance(cpu, int | float) and not isinstance(cpu, bool) and math.isfinite(cpu) and cpu > 0
        ):
            raise UserError(f"workload.sandbox_cpu_cores must be null or a finite number > 0, got {cpu!r}")
        stretch = self.workload.sandbox_busy_stretch
        number = isinstance(stretch, int | float) and not isinstance(stretch, bool)
        if not (number and math.isfinite(stretch) and stretch >= 1.0):
            raise UserError(f"workload.sandbox_busy_stretch must be a finite number >= 1, got {stretch!r}")
        self.train.validate(dev.gpus_per_node, self.workload.prompts_per_step * self.workload.group_size)
        fractions = {
            "rollout.gpu_memory_utilization": self.rollout.gpu_memory_utilization,
            "workload.prefix_cache_hit": self.workload.prefix_cache_hit,
        }
        for key, value in fractions.items():
            if not 0.0 <= value <= 1.0:
                raise UserError(f"{key} must be a fraction in [0, 1], got {value}")
        for key, value in vars(self.costs).items():  # divisors of the peaks: 0 would mean never finishing
            if key.endswith(("_mfu", "_efficiency")) and value is not None and not 0.0 < value <= 1.0:
                raise UserError(f"costs.{key} must be a fraction in (0, 1], got {value}")
        for key, value in vars(self.costs).items():
            if key.endswith("_s") and not (math.isfinite(value) and value >= 0):
                raise UserError(f"costs.{key} must be a finite number of seconds >= 0, got {value}")
        self._check_expert_parallel(model)
        self._check_profile(model, dev)
        self._check_context(model)

    def _check_context(self, model: specs.ModelSpec) -> None:
        """The longest request the workload can make fits the model's context (its max_position_embeddings): an
        engine refuses a longer one, so simulating it would describe a run that cannot happen."""
        w = self.workload
        if w.kind == "math":
            longest = int(w.prompt_tokens.max + w.response_tokens.max)
            what = (
                f"workload.prompt_tokens.max + workload.response_tokens.max ({w.prompt_tokens.max:g} + "
                f"{w.response_tokens.max:g})"
            )
            fix = "lower workload.response_tokens.max"
        else:
            longest, what, fix = w.max_context_tokens, "workload.max_context_tokens", "lower it"
        if longest > model.max_context:
            raise UserError(
                f"{what} is {longest:,} tokens, more than the {model.max_context:,}-token context of the model "
                f"{self.model!r}: {fix}, or choose a model with a longer context"
            )

    def _check_expert_parallel(self, model: specs.ModelSpec) -> None:
        """Expert parallelism needs routed experts, whole ones on each GPU, and (rollout) one engine's GPUs."""
        for key, ep in (
            ("rollout.expert_parallel", self.rollout.expert_parallel),
            ("train.expert_parallel", self.train.expert_parallel),
        ):
            if ep == 1:
                continue
            if not model.is_moe:
                raise UserError(f"{key}={ep} needs a mixture-of-experts model; {self.model} is dense (set it to 1)")
            if model.experts % ep:
                raise UserError(f"{key}={ep} must divide the {model.experts} routed experts of {self.model}")
        ep, tp = self.rollout.expert_parallel, self.rollout.tensor_parallel
        if tp % ep:
            raise UserError(
                f"rollout.expert_parallel={ep} must divide rollout.tensor_parallel={tp}: an engine's experts are "
                "spread over its own GPUs"
            )

    def _check_profile(self, model: specs.ModelSpec, dev: specs.DeviceSpec) -> None:
        """costs.profile: readable, measured on cluster.device, and holding a model the fit can use (one of known
        architecture, or the run's own): its constants are the device's, so the run's model need not be in it."""
        name = self.costs.profile
        if name is None:
            return
        try:
            profile = profiles.read_profile(name)
        except UserError as exc:
            raise UserError(f"costs.profile: {exc}") from None
        measured = profile.device.spec
        if measured is None or measured.lower() != dev.name.lower():
            on = f"{measured!r} ({profile.device.name})" if measured else f"{profile.device.name!r} (device.spec: null)"
            raise UserError(
                f"costs.profile: profile {name!r} was measured on {on}, not on cluster.device {dev.name!r}; "
                "calibrate from a profile of that device"
            )
        known = [m.model for m in profile.models if m.model.lower() in specs.models()]
        if not known and profiles.entry_for(profile, model, self.model) is None:
            have = ", ".join(m.model for m in profile.models) or "none"
            raise UserError(
                f"costs.profile: profile {name!r} measured no model whose architecture is known (it has {have}) and "
                f"not the run's model {self.model!r}: nothing to fit its constants to"
            )

    def _check_pool(self, key: str, dev: specs.DeviceSpec, num_gpus: int, price: float | None) -> None:
        """One device type's GPUs: a whole number of engines, engines within a node, a price >= 0."""
        tp = self.rollout.tensor_parallel
        if num_gpus < 1:
            raise UserError(f"{key}.num_gpus must be >= 1, got {num_gpus}")
        if num_gpus % tp:
            raise UserError(f"{key}.num_gpus={num_gpus} is not a multiple of rollout.tensor_parallel={tp}")
        if tp > dev.gpus_per_node or dev.gpus_per_node % tp:
            where = f" ({key}.device)" if key != "cluster" else ""
            raise UserError(f"rollout.tensor_parallel={tp} must divide the {dev.gpus_per_node} GPUs of a node{where}")
        if price is not None and price < 0:
            raise UserError(f"{key}.price_per_gpu_hour must be >= 0 or null, got {price}")

    def _check_positive(self) -> None:
        checks = {
            "seed": (self.seed, 0),
            "num_steps": (self.num_steps, 1),
            "cluster.num_gpus": (self.cluster.num_gpus, 1),
            "rollout.tensor_parallel": (self.rollout.tensor_parallel, 1),
            "rollout.max_num_seqs": (self.rollout.max_num_seqs, 1),
            "rollout.expert_parallel": (self.rollout.expert_parallel, 1),
            "workload.prompts_per_step": (self.workload.prompts_per_step, 1),
            "workload.group_size": (self.workload.group_size, 1),
            "workload.max_context_tokens": (self.workload.max_context_tokens, 2),
            "workload.sandbox_start_slots": (self.workload.sandbox_start_slots, 1),
        }
        for key, (value, lowest) in checks.items():
            if value < lowest:
                raise UserError(f"{key} must be >= {lowest}, got {value}")
        cores = self.cluster.host_cores
        if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores < 0):
            raise UserError(f"cluster.host_cores must be null or an integer >= 0, got {cores!r}")
        for key in ("host_token_s", "train_dp_overhead_s", "sync_busy_s"):
            value = getattr(self.costs, key)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise UserError(f"costs.{key} must be a finite number >= 0, got {value!r}")
        placement = self.costs.host_train_placement
        if not (isinstance(placement, int | float) and not isinstance(placement, bool) and 0 <= placement <= 1):
            raise UserError(f"costs.host_train_placement must be a number from 0 to 1, got {placement!r}")

    @property
    def num_resources(self) -> int:
        return self.total_gpus // self.rollout.tensor_parallel

    @property
    def total_gpus(self) -> int:
        pool = self.cluster.rollout_pool
        return self.cluster.num_gpus + (pool.num_gpus if pool is not None else 0)

    @property
    def train_fraction(self) -> float:
        """The share of resources in the train pool: pools.train_fraction, or with a rollout pool the
        train-capable GPUs' share (`split_pools` rounds num_resources x this back to their count)."""
        if self.cluster.rollout_pool is None:
            return self.pools.train_fraction
        return self.cluster.num_gpus / self.total_gpus

    @property
    def cluster_label(self) -> str:
        """The cluster in words: "64 x h800", or "32 x h800 + 32 x h20" (train-capable first) when mixed."""
        label = f"{self.cluster.num_gpus} x {device_name(self.cluster.device)}"
        pool = self.cluster.rollout_pool
        return label if pool is None else f"{label} + {pool.num_gpus} x {device_name(pool.device)}"

    @property
    def price_per_hour(self) -> float | None:
        """The whole cluster's price for an hour (None when unpriced)."""
        c, pool = self.cluster, self.cluster.rollout_pool
        if c.price_per_gpu_hour is None:
            return None
        return c.num_gpus * c.price_per_gpu_hour + (pool.num_gpus * pool.price_per_gpu_hour if pool else 0.0)


def device_name(device: str) -> str:
    """A `cluster.device` value as people read it: a shipped device's name, or a device file's `name` field
    (its stem when the file has none), not the file's path."""
    return specs.device(device).name


def _spec(key: str, lookup, name: str):
    """A model or device spec by name or file; a bad one is a UserError naming the config key first."""
    try:
        return lookup(name)
    except UserError as exc:
        raise UserError(f"{key}: {exc}") from None


# Switches with defaults of their own: choosing a value (in any --config file or by --set) brings that file's
# values in right over default.yaml, before the user's files, so that the user's own keys still win. A user file
# that sets only `workload: {kind: swe}` then gets the SWE workload's lengths and sizes, not the math ones.
KIND_DEFAULTS = {"workload.kind": {"swe": CONFIG_DIR / "swe.yaml"}}

ConfigPaths = str | Path | list[str | Path] | tuple[str | Path, ...] | None


def load_config(paths: ConfigPaths = None, overrides: list[str] | None = None) -> SimConfig:
    """Default config, the defaults of each kind it chooses (KIND_DEFAULTS), then the file(s) at `paths` merged
    over it in order (later files win key by key), then `key.path=value` overrides."""
    data, _ = resolve(paths, overrides)
    return cfgio.from_dict(SimConfig, data)


def resolve(paths: ConfigPaths = None, overrides: list[str] | None = None) -> tuple[dict, list[Path]]:
    """The merged config as a mapping (not yet checked against SimConfig), and the files merged in order:
    default.yaml, a chosen kind's defaults file, the user's files (`merged_note` names them)."""
    users = [Path(p) for p in ([paths] if isinstance(paths, str | Path) else paths or ())]
    users = [p for p in users if p.resolve() != DEFAULT_CONFIG.resolve()]
    loaded = [cfgio.load_yaml(p) for p in users]  # every file read (a bad one fails) before anything is merged
    user_data: dict = {}
    for one in loaded:
        user_data = cfgio.merge(user_data, one)
    default = cfgio.load_yaml(DEFAULT_CONFIG)
    chosen = cfgio.apply_overrides(cfgio.merge(default, user_data), overrides or [])
    files, data = [DEFAULT_CONFIG], default
    given = {p.resolve() for p in users}
    for key, kinds in KIND_DEFAULTS.items():
        extra = kinds.get(_lookup(chosen, key))  # an unhashable value is the checks' to report
        if extra is not None and extra.resolve() not in given:
            files.append(extra)
            data = cfgio.merge(data, cfgio.load_yaml(extra))
    data = cfgio.apply_overrides(cfgio.merge(data, user_data), overrides or [])
    return data, [*files, *users]


def _lookup(data: dict, key: str):
    for part in key.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data if isinstance(data, str) else None


def merged_note(files: list[Path]) -> str:
    """The line a command prints on stderr: `config: sim/configs/default.yaml + sim/configs/swe.yaml + my.yaml`."""
    return "config: " + " + ".join(_shown(p) for p in files)


def _shown(path: Path) -> str:
    """A shipped file relative to the current folder when inside it; a user's file as given."""
    if path.is_absolute():
        try:
            return str(path.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            return str(path)
    return str(path)


def config_dict(cfg: SimConfig) -> dict:
    return cfgio.to_dict(cfg)
