"""`python -m reference train --dry-run`: what a run would start, printed without starting anything.

The plan is read from the config alone: no engine, trainer, Ray, vLLM, Docker or GPU is touched, so it
runs on any machine in seconds, for a cluster the machine is not part of. It gives

- the resources the policy lays out (`core.policies.make_policy`, as `reference/train.py` does), their
  capability tags, the active tag each starts on, and the GPUs each owns (`resources.gpus_per_resource`);
- the engines: one per resource that can roll out, tensor parallel over the resource's GPUs, with the
  backend, the batch limit and the longest request (the task's context);
- what runs at once: GRPO groups (`rollout.max_concurrency` samples, whole groups), episodes (a task with
  sandboxes runs at most `task.options.concurrency`), sandboxes, and the sequences a serving engine holds;
- memory per GPU from the simulator's models, not derived again here: the model's shape from
  `core.specs` (a checkpoint's `config.json` through `core/specs/hf_config.py`), an engine's weights and
  KV-cache capacity from `sim.cost.CostModel`, the trainer's state, gather buffers and activations from
  `sim.train_layout` (FSDP over the train GPUs: tensor and pipeline parallel 1);
- whether it fits: `fits: yes`, or one `fits: no:` line for each part that does not.

Departures from the simulator's defaults, to describe this runtime (`trainer_parallel`): its trainer keeps
fp32 master weights, fp32 gradients and AdamW's two fp32 moments (16 bytes a parameter), sharded over the
train resources with `fsdp` and a full replica on each without; its activations are fp32 (twice the
simulator's bf16 estimate) unless `param_dtype` is bfloat16, every layer's kept unless
`activation_checkpointing` recomputes them; a micro-batch is `trainer.micro_batch_size` sequences of up to
the task's context. vLLM takes `VLLM_MEMORY_FRACTION` of a
GPU. As in the simulator, a train-capable resource that rolls out keeps the trainer's weight shard beside
its engine (the optimizer state offloaded) and a training resource's engine holds nothing. On CPU
(`gpus_per_resource` 0) memory is RAM per resource (the built-in engine's fp32 weights and a KV cache
that grows with its sequences), and the verdict compares all resources' sum with this machine's memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from core import config as cfgio
from core import specs
from core.errors import UserError
from core.policies import BasePolicy, make_policy
from core.specs import DeviceSpec, ModelSpec
from core.tags import Tag
from reference.control.config import TrainConfig, check_feasible, policy_config
from reference.engine.backends import BACKENDS, backend

GB = 1e9
FP32_PER_BF16 = 2  # the runtime's trainer and built-in engine compute in fp32; the simulator counts bf16
VLLM_MEMORY_FRACTION = 0.85  # reference/engine/vllm_engine.py `engine_args`: gpu_memory_utilization
# The simulator's config must name a shipped model and device; the plan passes the real spec to every
# function it calls, and a CPU plan reads no device figure, so these only satisfy the config's checks.
PLACEHOLDER_MODEL, PLACEHOLDER_DEVICE = "qwen3-0.6b", "h800"


@dataclass(frozen=True)
class TaskPlan:
    """What the plan needs of a task, read from its config without constructing anything that needs Docker."""

    context_tokens: int  # the longest request: the engines' context and the trainer's longest sequence
    concurrency: int | None  # episodes the task runs at once (None: no limit of its own)
    sandboxed: bool  # each running episode holds a sandbox
    summary: str  # one line about the task's settings


@dataclass(frozen=True)
class InFlight:
    groups: int  # GRPO groups running at once
    episodes: int  # episodes (samples) running at once
    sandboxes: int
    serving: int  # engines serving when the run starts (resources whose active tag is rollout)
    per_engine: int  # sequences one serving engine holds at most


@dataclass(frozen=True)
class Memory:
    """GB per GPU (per resource on CPU), by part; KV capacities in tokens (None on CPU: allocated as used)."""

    engine_weights: float
    kv_capacity: int | None  # an engine's KV cache on a rollout-only resource
    kv_capacity_beside_trainer: int | None  # on a train-capable resource, beside the trainer's weight shard
    kv_needed: float  # the KV cache of `per_engine` sequences at full context
    trainer_shard: float  # the trainer's weight shard kept beside a train-capable resource's engine
    train: object  # sim.train_layout.TrainMemory: state, gather buffers, activations


def plan(cfg: TrainConfig) -> str:
    """The run's plan as text (see the module docstring); UserError for what the config cannot describe."""
    task = task_plan(cfg)
    model = model_spec(cfg, task)
    pcfg = policy_config(cfg)
    gpus = cfg.resources.gpus_per_resource
    policy = make_policy(cfg.policy.name, pcfg, cfg.resources.count, cfg.resources.train_fraction, max(1, gpus))
    flight = in_flight(cfg, task, policy)
    device = specs.device(cfg.resources.gpu) if gpus else None
    memory = estimate_memory(cfg, model, device, policy, task, flight)
    lines = [
        *_header(cfg, task, model, device),
        *_resources(cfg, policy),
        *_work(cfg, task, policy, flight),
        *_memory_lines(cfg, device, memory, task, flight),
    ]
    problems = _problems(cfg, model, device, memory, task, policy)
    notes = _notes(memory, task, flight)
    return "\n".join(lines + notes + ([f"fits: no: {p}" for p in problems] or ["fits: yes"]))


# ---- what the config says ----


def task_plan(cfg: TrainConfig) -> TaskPlan:
    """The task's facts from its config. The SWE task is read from its config class (constructing the task checks
    for a Docker daemon); any other task is constructed, as `validate` does."""
    name, options = cfg.task.name, cfg.task.options
    if name == "swe":
        from swebench_env.training import SweTaskConfig

        try:
            c = SweTaskConfig(**options)
        except TypeError as e:
            raise UserError(f"task: {e}".replace("SweTaskConfig.__init__() ", "")) from None
        summary = (
            f"agent {c.agent}, sandbox {c.sandbox}, at most {c.max_turns} turns of {c.max_tokens} tokens, "
            f"context {c.context_tokens} tokens, {c.command_timeout_s:g} s a command"
        )
        return TaskPlan(c.context_tokens, c.concurrency, True, summary)
    from reference.tasks import make_task

    try:
        task = make_task(name, **options)
    except (ValueError, TypeError) as e:
        raise UserError(f"task: {e}") from None
    summary = f"one request an episode, up to {task.max_tokens} tokens generated"
    return TaskPlan(_context(task), None, False, summary)


def _context(task) -> int:
    """`control.layout.task_context`'s rule (that module imports torch and transformers, seconds here; a test
    holds the two equal): what the task declares, else twice the longest held-out prompt and its answer."""
    if (declared := getattr(task, "context_tokens", None)) is not None:
        return declared
    longest = max(len(task.tokenizer.encode(p.prompt)) for p in task.held_out())
    return max(64, 2 * (longest + task.max_tokens))


def model_spec(cfg: TrainConfig, task: TaskPlan) -> ModelSpec:
    """The model's shape: the checkpoint's config.json, or the fresh tiny model the config describes."""
    if cfg.model.dir is not None:
        return specs.model(os.path.join(cfg.model.dir, "config.json"))
    m = cfg.model
    return ModelSpec(
        name="tiny (fresh)",
        layers=m.num_layers,
        hidden=m.hidden_size,
        heads=m.num_heads,
        kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        intermediate=m.intermediate_size,
        vocab=_tiny_vocab(cfg),
        tie_embeddings=True,
        max_context=task.context_tokens,
        qk_norm=True,
    )


def _tiny_vocab(cfg: TrainConfig) -> int:
    """The fresh model's vocabulary: its task's tokenizer (`control/layout.py`)."""
    if cfg.task.name == "swe":
        from reference.tokenizer import Tokenizer, default_tokenizer

        path = cfg.task.options.get("tokenizer")
        return (Tokenizer.load(path) if path else default_tokenizer()).vocab_size
    from reference.tasks import make_task

    return make_task(cfg.task.name, **cfg.task.options).tokenizer.vocab_size


def in_flight(cfg: TrainConfig, task: TaskPlan, policy: BasePolicy) -> InFlight:
    """Groups, episodes and sandboxes at once, and the sequences one serving engine holds at most."""
    r = cfg.rollout
    groups = max(1, r.max_concurrency // r.group_size)  # reference/rollout/groups.py: a slot holds a whole group
    episodes = groups * r.group_size
    if task.concurrency is not None:
        episodes = min(episodes, task.concurrency)
    serving = sum(policy.initial_active(n) is Tag.ROLLOUT for n in policy.resources) or len(policy.resources)
    per_engine = min(cfg.engine.max_batch, math.ceil(episodes / serving))
    return InFlight(groups, episodes, episodes if task.sandboxed else 0, serving, per_engine)


# ---- the simulator's models ----


def estimate_memory(
    cfg: TrainConfig, model: ModelSpec, device: DeviceSpec | None, policy: BasePolicy, task: TaskPlan, flight: InFlight
) -> Memory:
    from sim import train_layout
    from sim.cost import CostModel

    sim_cfg = _sim_config(cfg, task, device)
    lay_device = device or specs.device(PLACEHOLDER_DEVICE)
    tp = sim_cfg.rollout.tensor_parallel
    train_gpus = sum(policy.resources[r].devices for r in policy.trainers)
    lay = train_layout.layout(sim_cfg, model, lay_device, train_gpus)
    tokens, par = sim_cfg.train.micro_batch_tokens, cfg.trainer_parallel
    mode = "full" if par.activation_checkpointing else "none"
    width = 1 if par.param_dtype == "bfloat16" else FP32_PER_BF16
    from reference.trainer.config import TrainerConfig

    chunk = cfg.trainer.get("logit_chunk_tokens", TrainerConfig.logit_chunk_tokens)  # the loss's fp32 logits
    act = (
        width * train_layout.activation_bytes(model, lay, mode, tokens, 0)
        + train_layout.logit_bytes(model, tokens, chunk)
    ) / GB
    sim_cfg = dataclasses.replace(sim_cfg, train=dataclasses.replace(sim_cfg.train, activation_gb=act))
    train = train_layout.memory(sim_cfg, model, lay_device, train_gpus, task.context_tokens)
    if not par.fsdp:  # plain data parallel: every trainer holds the whole state, and gathers nothing
        train = dataclasses.replace(train, state_gb=train.state_gb * train_gpus, buffers_gb=0.0)
    scale = 1 if device else FP32_PER_BF16  # the built-in engine on CPU holds fp32 weights and KV
    cost = CostModel(sim_cfg, model, device) if device else None
    return Memory(
        engine_weights=scale * model.weight_bytes / tp / GB,
        kv_capacity=cost.kv_capacity_tokens(0) if cost else None,
        kv_capacity_beside_trainer=cost.kv_capacity_tokens(train_gpus) if cost else None,
        kv_needed=scale * flight.per_engine * task.context_tokens * model.kv_bytes_per_token / tp / GB,
        trainer_shard=model.weight_bytes / train_gpus / GB,
        train=train,
    )


def _sim_config(cfg: TrainConfig, task: TaskPlan, device: DeviceSpec | None):
    """The simulator's config for this run's layout: sim/configs/default.yaml with the runtime's settings."""
    from sim.config import DEFAULT_CONFIG, SimConfig

    gpus = max(1, cfg.resources.gpus_per_resource)
    mirror = {
        "seed": cfg.run.seed,
        "num_steps": cfg.policy.num_steps,
        "model": PLACEHOLDER_MODEL if cfg.model.dir is None else os.path.join(cfg.model.dir, "config.json"),
        "cluster": {"device": device.name if device else PLACEHOLDER_DEVICE, "num_gpus": cfg.resources.count * gpus},
        "pools": {"train_fraction": cfg.resources.train_fraction},
        "rollout": {
            "tensor_parallel": gpus,
            "max_num_seqs": cfg.engine.max_batch,
            "max_num_batched_tokens": max(8192, cfg.engine.max_batch),
            "gpu_memory_utilization": VLLM_MEMORY_FRACTION,
        },
        "train": {
            "grad_bytes_per_param": 4,  # fp32 gradients
            "optimizer_bytes_per_param": 10,  # the fp32 weights' other half (2) + AdamW's two fp32 moments (8)
            "recompute_logprobs": False,
            "reference_model": cfg.trainer.get("kl_coef", 0) > 0,
            "tensor_parallel": 1,
            "pipeline_parallel": 1,
            "activation_recompute": "none",
            "micro_batch_tokens": _micro_batch_tokens(cfg, task),
            "mini_batches": 1,
            "fsdp_root_gathered": True,
        },  # its FSDP shards the decoder layers and the root
        "workload": {"prompts_per_step": cfg.rollout.prompts_per_step, "group_size": cfg.rollout.group_size},
    }
    return cfgio.from_dict(SimConfig, cfgio.merge(cfgio.load_yaml(DEFAULT_CONFIG), mirror))


def _micro_batch_words(cfg: TrainConfig, task: TaskPlan) -> str:
    if cfg.trainer.get("micro_batch_tokens"):
        return f"up to {cfg.trainer['micro_batch_tokens']} padded tokens (trainer.micro_batch_tokens)"
    return f"{_micro_batch_sequences(cfg)} sequences of up to {task.context_tokens} tokens"


def _micro_batch_tokens(cfg: TrainConfig, task: TaskPlan) -> int:
    """Padded tokens of the largest micro-batch: `trainer.micro_batch_tokens` where set (a sequence longer than
    that budget is a micro-batch of its own), else `micro_batch_size` sequences of the task's context."""
    budget = cfg.trainer.get("micro_batch_tokens") or 0
    return max(budget, task.context_tokens) if budget else _micro_batch_sequences(cfg) * task.context_tokens


def _micro_batch_sequences(cfg: TrainConfig) -> int:
    from reference.trainer.config import TrainerConfig

    return cfg.trainer.get("micro_batch_size", TrainerConfig.micro_batch_size)


# ---- the printed plan ----


def _header(cfg: TrainConfig, task: TaskPlan, model: ModelSpec, device: DeviceSpec | None) -> list[str]:
    r, gpus = cfg.resources, cfg.resources.gpus_per_resource
    where = (
        f"{r.count} x {gpus} GPUs ({device.name}: {device.hbm_gb:g} GB) = {r.count * gpus} GPUs"
        if device
        else f"{r.count} x {r.cores_per_resource} CPU cores"
    )
    ray = (
        f"joins the Ray cluster at {cfg.run.ray_address}"
        if cfg.run.ray_address
        else "starts a local Ray" + (" on this machine (a cluster: --ray-address ADDR)" if device else "")
    )
    return [
        f"plan of `train` (--dry-run: nothing was started): task {cfg.task.name}, policy {cfg.policy.name}, "
        f"{cfg.policy.num_steps} steps of {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples",
        f"task: {task.summary}",
        f"model: {model.name}: {model.params / 1e9:.3g} B parameters, {model.layers} layers, hidden {model.hidden}, "
        f"{model.heads} heads / {model.kv_heads} KV heads of {model.head_dim}; KV cache "
        f"{model.kv_bytes_per_token / 1024:g} KiB a token (bf16)",
        f"resources: {where}; the run {ray}",
    ]


def _resources(cfg: TrainConfig, policy: BasePolicy) -> list[str]:
    unit = "GPUs" if cfg.resources.gpus_per_resource else "cores"
    each = cfg.resources.gpus_per_resource or cfg.resources.cores_per_resource
    rows = [f"  {'name':<6}{'capability tags':<18}{'active at start':<17}{unit}"]
    for name, res in policy.resources.items():
        tags = ", ".join(res.tag_names)
        rows.append(f"  {name:<6}{tags:<18}{policy.initial_active(name).value:<17}{each}")
    return [f"resources under policy {policy.name}:", *rows]


def _work(cfg: TrainConfig, task: TaskPlan, policy: BasePolicy, f: InFlight) -> list[str]:
    engines = sum(res.can(Tag.ROLLOUT) for res in policy.resources.values())
    tp = max(1, cfg.resources.gpus_per_resource)
    trainers = policy.trainers
    train_gpus = sum(policy.resources[r].devices for r in trainers)
    over = f"{train_gpus} GPUs" if cfg.resources.gpus_per_resource else f"{len(trainers)} resources"
    dp = f"{'FSDP' if cfg.trainer_parallel.fsdp else 'data parallel (whole replicas)'} over {over}"
    limit = f" (task.options.concurrency {task.concurrency})" if task.concurrency is not None else ""
    sandboxes = f", {f.sandboxes} sandboxes" if task.sandboxed else ", no sandboxes"
    return [
        f"engines: {engines}, backend {cfg.engine.backend}, tensor parallel {tp}, max batch {cfg.engine.max_batch}, "
        f"context {task.context_tokens} tokens",
        _weights_line(cfg),
        f"trainer: {len(trainers)} train-capable resources, {dp}, micro-batches of {_micro_batch_words(cfg, task)}",
        f"in flight: {f.groups} groups of {cfg.rollout.group_size} (rollout.max_concurrency "
        f"{cfg.rollout.max_concurrency}) -> {f.episodes} episodes{limit}{sandboxes}; {f.serving} engines serve at "
        f"the start: up to {f.per_engine} sequences each",
    ]


def _weights_line(cfg: TrainConfig) -> str:
    """How each new version reaches the engines (`engine.weights_transport`, control/transport.py)."""
    if cfg.engine.weights_transport == "directory":
        return (
            "weights: each new version a directory under OUT/weights/, read by every engine (a filesystem every "
            "worker sees)"
        )
    where = cfg.engine.weights_local_root or "its Ray node's temp dir"
    return (
        f"weights: each new version through Ray's object store in {backend(cfg.engine.backend).weights_dtype}, copied "
        f"to each engine's node (under {where}); nothing is shared but Ray"
    )


def _memory_lines(cfg: TrainConfig, device: DeviceSpec | None, m: Memory, task: TaskPlan, f: InFlight) -> list[str]:
    t = m.train
    need = f"{f.per_engine} sequences at full context need {m.kv_needed:.1f} GB"
    par = cfg.trainer_parallel
    held = "sharded" if par.fsdp else "a whole replica: trainer_parallel.fsdp is off"
    state = f"state {t.state_gb:.1f} GB (fp32 weights, gradients and AdamW moments, {held})"
    act = f"activations {t.activations_gb:.1f} GB ({t.micro_batch_tokens} tokens, {_activations(par)})"
    if device is None:
        return [
            "memory per resource (RAM; the simulator's models):",
            f"  engine: weights {_size(m.engine_weights)}, KV cache grows with its sequences: {f.per_engine} "
            f"sequences of {task.context_tokens} tokens take {_size(m.kv_needed)}",
            f"  trainer: state {_size(t.state_gb)}, activations {_size(t.activations_gb)} "
            f"({t.micro_batch_tokens} tokens, {_activations(par)})",
        ]
    usable = device.hbm_gb * VLLM_MEMORY_FRACTION
    return [
        f"memory per GPU ({device.name}, {device.hbm_gb:g} GB; vLLM takes {VLLM_MEMORY_FRACTION:g} of it: "
        f"{usable:.1f} GB; the simulator's models):",
        f"  rollout-only resource: weights {m.engine_weights:.1f} GB, KV cache {_tokens(m.kv_capacity, task)}; {need}",
        f"  train-capable, rolling out: weights {m.engine_weights:.1f} GB + the trainer's weight shard "
        f"{m.trainer_shard:.1f} GB, KV cache {_tokens(m.kv_capacity_beside_trainer, task)}",
        f"  train-capable, training: {state} + gather buffers {t.buffers_gb:.1f} GB + {act} = {t.total_gb:.1f} GB",
    ]


def _tokens(capacity: int | None, task: TaskPlan) -> str:
    return f"{capacity:,} tokens ({(capacity or 0) / task.context_tokens:.1f} sequences at full context)"


def _size(gb: float) -> str:
    return f"{gb:.1f} GB" if gb >= 1 else f"{gb * 1000:.1f} MB"


def _notes(m: Memory, task: TaskPlan, f: InFlight) -> list[str]:
    if m.kv_capacity is None or m.kv_capacity < task.context_tokens:
        return []
    held = m.kv_capacity // task.context_tokens
    if held >= f.per_engine:
        return []
    return [
        f"note: an engine's KV cache holds {held} of its {f.per_engine} sequences at full context; vLLM "
        f"preempts the rest (recomputed later) when contexts grow that long"
    ]


def _problems(
    cfg: TrainConfig, model: ModelSpec, device: DeviceSpec | None, m: Memory, task: TaskPlan, policy: BasePolicy
) -> list[str]:
    """One line for each thing that does not fit or cannot run."""
    if device is None:
        return _cpu_problems(cfg, m)
    out = []
    out.append(
        "the workers do not place GPUs yet: Ray actors ask for none, an engine starts with tensor parallel 1 "
        "and a trainer shard on CPU (control/worker.py)"
    )
    if not BACKENDS[cfg.engine.backend].gpu:
        gpu_backends = ", ".join(name for name, entry in BACKENDS.items() if entry.gpu)
        out.append(f"backend {cfg.engine.backend!r} runs on CPU cores: GPUs need --backend {gpu_backends}")
    if task.context_tokens > model.max_context:
        out.append(
            f"the task's context ({task.context_tokens} tokens) exceeds the model's {model.max_context} positions"
        )
    usable = device.hbm_gb * VLLM_MEMORY_FRACTION
    if m.engine_weights >= usable:
        out.append(
            f"an engine's weights ({m.engine_weights:.1f} GB a GPU) exceed vLLM's {usable:.1f} GB: raise "
            f"resources.gpus_per_resource"
        )
    low = min(m.kv_capacity or 0, m.kv_capacity_beside_trainer or 0) if policy.trainers else m.kv_capacity or 0
    if m.engine_weights < usable and low < task.context_tokens:
        out.append(
            f"an engine's KV cache holds {low} tokens, less than one request of {task.context_tokens}: "
            f"raise resources.gpus_per_resource or lower the task's context"
        )
    if m.train.total_gb > device.hbm_gb:
        out.append(_train_problem(cfg, m, device, task))
    return out


def _train_problem(cfg: TrainConfig, m: Memory, device: DeviceSpec, task: TaskPlan) -> str:
    t = m.train
    head = (
        f"training needs {t.total_gb:.1f} GB a GPU, {t.total_gb - device.hbm_gb:.1f} GB more than the "
        f"{device.hbm_gb:g} GB of a {device.name}"
    )
    par = cfg.trainer_parallel
    if t.activations_gb < t.state_gb:
        if not par.fsdp:
            return f"{head}; most of it the state, whole on every trainer: set trainer_parallel.fsdp=true"
        return f"{head}; most of it the sharded state: add train-capable GPUs"
    if cfg.trainer.get("micro_batch_tokens") and _micro_batch_tokens(cfg, task) > task.context_tokens:
        one = f"to {task.context_tokens}: one sequence at a time"
        return f"{head}; most of it activations: lower trainer.micro_batch_tokens ({one})"
    if not cfg.trainer.get("micro_batch_tokens") and _micro_batch_sequences(cfg) > 1:
        return f"{head}; most of it activations: lower trainer.micro_batch_size (1: one sequence at a time)"
    remedies = [
        *(["trainer_parallel.activation_checkpointing=true"] if not par.activation_checkpointing else []),
        *(["trainer_parallel.param_dtype=bfloat16 (with fsdp)"] if par.param_dtype != "bfloat16" else []),
    ]
    remedy = f"set {' and '.join(remedies)}, or lower the task's context" if remedies else "lower the task's context"
    return (
        f"{head}; most of it the activations of one {task.context_tokens}-token sequence "
        f"({_activations(par)}): {remedy}"
    )


def _activations(par) -> str:
    """How the trainer holds activations, in the plan's words."""
    dtype = "bf16" if par.param_dtype == "bfloat16" else "fp32"
    return f"{dtype}, {'recomputed a layer at a time' if par.activation_checkpointing else 'no recompute'}"


def _cpu_problems(cfg: TrainConfig, m: Memory) -> list[str]:
    out = []
    if BACKENDS[cfg.engine.backend].gpu:
        out.append(f"backend {cfg.engine.backend!r} needs GPUs: set resources.gpus_per_resource and resources.gpu")
    if cfg.run.ray_address is None:
        try:
            check_feasible(cfg)
        except UserError as e:
            out.append(str(e))
    per_resource = m.engine_weights + m.kv_needed + m.train.total_gb
    total, have = cfg.resources.count * per_resource, _machine_gb()
    if have is not None and total > have:
        out.append(f"the {cfg.resources.count} resources need {total:.1f} GB of memory; this machine has {have:.1f} GB")
    return out


def _machine_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    except (ValueError, OSError):
        return None
