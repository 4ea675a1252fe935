"""The training run's one config: YAML defaults (`reference/configs/train.yaml`), `--config FILE` merged over
them (repeatable: later files win; `--task swe` alone brings `swe.yaml` first), `--set key.path=value`
overrides, validated on construction; the resolved
config is saved with every run. Feasibility against the resources (cores, pools, batch shape) is checked in
`check_feasible` before anything starts, with one clear line per problem.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.config import apply_overrides, from_dict, load_yaml, merge
from core.errors import UserError
from core.policies import POLICIES, PolicyConfig, PolicySettings
from reference.engine.backends import LOGPROBS_MODES, logprobs_temperature, training_backends

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "train.yaml"
# A task named on the command line brings its recipe (merged over train.yaml before the user's files).
TASK_DEFAULTS = {"swe": DEFAULT_CONFIG.parent / "swe.yaml"}
WEIGHT_TRANSPORTS = ("directory", "object_store")  # engine.weights_transport: see control/transport.py
MAX_EVAL_SAMPLES = 64  # episodes of a problem an evaluation may run


@dataclass(frozen=True)
class TaskSection:
    name: str  # a task in reference.tasks.TASKS, or a class of your own as package.module:Class
    options: dict  # the task's config fields (e.g. digits)


@dataclass(frozen=True, kw_only=True)
class PolicySection(PolicySettings):
    """The policy's settings (`core/policies/settings.py`: every key but these two), its name and the run's length."""

    name: str  # colocated | disaggregated | async | tag | streaming
    num_steps: int  # training steps in the run


@dataclass(frozen=True)
class ResourcesSection:
    count: int  # resources (worker processes), each with its own cores
    cores_per_resource: int  # CPU cores each resource owns (pinned)
    train_fraction: float  # share of resources in the train pool (disaggregated, async, tag)
    gpus_per_resource: int = 0  # GPUs each resource owns, its engine tensor parallel over all of them (0: CPU
    # cores only); the vllm backend's layout, read by the dry-run's plan (control/plan.py)
    gpu: str | None = None  # their device type: a name in core/specs/devices.yaml or a device YAML file


@dataclass(frozen=True)
class RolloutSection:
    prompts_per_step: int  # GRPO groups per training step
    group_size: int  # samples per prompt
    max_concurrency: int  # completion requests in flight
    temperature: float  # the engines' sampling temperature, in (0, 2]; the trainer scores at it (trainer_settings)


@dataclass(frozen=True)
class ModelSection:
    dir: str | None  # a local Qwen3 checkpoint to train; null: a fresh tiny model for the task
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    initializer_range: float  # std of the fresh model's initial weights
    init_seed: int  # weights of the fresh model


@dataclass(frozen=True)
class EngineSection:
    backend: str  # an engine backend that trains (reference/engine/backends.py): builtin (CPU) | vllm (GPUs)
    max_batch: int  # sequences an engine decodes together
    coalesce_s: float = 0.0  # > 0: an engine's stream waits this long after a token for more, sent as one line
    weights_transport: str = "directory"  # how each new version reaches the engines (control/transport.py):
    # directory (OUT/weights/, which every worker must see) | object_store (Ray's, to a copy on each engine's node)
    weights_local_root: str | None = None  # object_store: where a worker keeps its copies (null: its node's temp dir)
    logprobs_mode: str = "processed"  # the behaviour log-probs the engines record and the trainer scores at:
    # processed (of the distribution sampled from, at rollout.temperature) | raw (of the model at temperature 1)


@dataclass(frozen=True)
class TrainerParallelSection:
    fsdp: bool = False  # shard parameters, gradients and optimiser moments over the train resources (FSDP2)
    param_dtype: str = "float32"  # float32 | bfloat16 (FSDP's mixed precision: fp32 master weights)
    activation_checkpointing: bool = False  # decoder layers recompute their activations in the backward

    def __post_init__(self) -> None:
        from reference.trainer.parallel import PARAM_DTYPES

        for key in ("fsdp", "activation_checkpointing"):
            if not isinstance(getattr(self, key), bool):
                raise UserError(f"trainer_parallel.{key} must be true or false, got {getattr(self, key)!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise UserError(
                f"trainer_parallel.param_dtype must be one of {', '.join(PARAM_DTYPES)}, got {self.param_dtype!r}"
            )
        if self.param_dtype != "float32" and not self.fsdp:
            raise UserError(
                f"trainer_parallel.param_dtype {self.param_dtype} needs trainer_parallel.fsdp=true "
                "(mixed precision keeps fp32 master weights in FSDP's shards)"
            )


@dataclass(frozen=True)
class RunSection:
    seed: int
    eval_every_steps: int  # held-out evaluation every this many steps (0: only before and after)
    checkpoint_every_steps: int  # resumable checkpoint every this many steps (0: never)
    ray_address: str | None  # join this Ray cluster (null: start a local one sized to this machine)
    time_limit_s: float  # the run stops with an error after this long
    eval_samples: int = 1  # episodes of each problem in an evaluation (pass@1 is their mean reward)
    held_out_samples: int | None = None  # episodes of each held-out problem (null: eval_samples)
    evaluate: bool = True  # false: no held-out evaluation at all (a run that measures throughput, not learning)


@dataclass(frozen=True)
class TrainConfig:
    task: TaskSection
    policy: PolicySection
    resources: ResourcesSection
    rollout: RolloutSection
    model: ModelSection
    engine: EngineSection
    trainer: dict  # reference.trainer.config.TrainerConfig fields (temperature: rollout's, see trainer_settings)
    run: RunSection
    warm_start: dict  # reference.trainer.supervised.SupervisedConfig fields; steps 0: no warm start
    trainer_parallel: TrainerParallelSection = TrainerParallelSection()

    def __post_init__(self) -> None:
        if self.policy.name not in POLICIES:
            raise UserError(f"unknown policy {self.policy.name!r}; choose one of {', '.join(POLICIES)}")
        if self.engine.backend not in training_backends():
            raise UserError(
                f"unknown backend {self.engine.backend!r} for training; choose one of {', '.join(training_backends())}"
            )
        positive = {
            "policy.num_steps": self.policy.num_steps,
            "resources.count": self.resources.count,
            "resources.cores_per_resource": self.resources.cores_per_resource,
            "rollout.prompts_per_step": self.rollout.prompts_per_step,
            "rollout.max_concurrency": self.rollout.max_concurrency,
            "engine.max_batch": self.engine.max_batch,
        }
        for key, value in positive.items():
            if value < 1:
                raise UserError(f"{key} must be >= 1, got {value}")
        if self.rollout.group_size < 2:
            raise UserError(
                f"rollout.group_size must be >= 2 (GRPO compares samples of a prompt), got {self.rollout.group_size}"
            )
        if self.engine.weights_transport not in WEIGHT_TRANSPORTS:
            raise UserError(
                f"unknown engine.weights_transport {self.engine.weights_transport!r}; choose one of "
                f"{', '.join(WEIGHT_TRANSPORTS)}"
            )
        if self.engine.logprobs_mode not in LOGPROBS_MODES:
            raise UserError(
                f"unknown engine.logprobs_mode {self.engine.logprobs_mode!r}; choose one of {', '.join(LOGPROBS_MODES)}"
            )
        if not 0 <= self.engine.coalesce_s <= 1:  # also refuses NaN
            raise UserError(f"engine.coalesce_s must be in [0, 1] seconds, got {self.engine.coalesce_s}")
        if self.model.dir is not None and not Path(self.model.dir).is_dir():
            raise UserError(f"model.dir {self.model.dir!r} is not a directory (a local Qwen3 checkpoint)")
        if not isinstance(self.run.evaluate, bool):
            raise UserError(f"run.evaluate must be true or false, got {self.run.evaluate!r}")
        if not 1 <= self.run.eval_samples <= MAX_EVAL_SAMPLES:
            raise UserError(f"run.eval_samples must be in [1, {MAX_EVAL_SAMPLES}], got {self.run.eval_samples}")
        held = self.run.held_out_samples
        if held is not None and not 1 <= held <= MAX_EVAL_SAMPLES:
            raise UserError(f"run.held_out_samples must be null or in [1, {MAX_EVAL_SAMPLES}], got {held!r}")
        if not self.run.time_limit_s > 0:
            raise UserError(f"run.time_limit_s must be > 0, got {self.run.time_limit_s}")
        _check_gpus(self.resources)
        _check_temperature(self.rollout.temperature, self.trainer, scoring_temperature(self))
        from reference.trainer.config import TrainerConfig

        try:  # the trainers build it inside their workers: a bad value must stop the run before they start
            TrainerConfig.from_dict({**self.trainer, "temperature": scoring_temperature(self)})
        except (ValueError, TypeError) as e:
            raise _section_error(
                "trainer", str(e).replace("TrainerConfig.", "trainer.").replace("__init__() ", "")
            ) from None
        if self.warm_start.get("steps", 0):
            from reference.trainer.supervised import SupervisedConfig

            try:
                SupervisedConfig.from_section(self.warm_start)
            except (ValueError, TypeError) as e:
                raise _section_error("warm_start", str(e).replace("SupervisedConfig.__init__() ", "")) from None


def policy_config(cfg: TrainConfig, num_steps: int | None = None) -> PolicyConfig:
    """The scheduling policy's knobs for this run (`num_steps`: the steps left, where a resumed run has fewer)."""
    p = cfg.policy
    steps = p.num_steps if num_steps is None else num_steps
    return PolicyConfig.of(p, batch_groups=cfg.rollout.prompts_per_step, num_steps=steps)


def scoring_temperature(cfg: TrainConfig) -> float:
    """The temperature the trainer scores tokens at: the rollouts' where the engines record processed log-probs
    (of softmax(logits / rollout.temperature), what was sampled from), 1 where they record raw ones."""
    return logprobs_temperature(cfg.engine.logprobs_mode, cfg.rollout.temperature)


def trainer_settings(cfg: TrainConfig) -> dict:
    """The TrainerConfig fields the run's trainers get: the `trainer` section, with the temperature of the engines'
    log-probs (`scoring_temperature`: the trainer must score the distribution they are of), the run's seed and its
    checkpoint cadence."""
    return {
        **cfg.trainer,
        "temperature": scoring_temperature(cfg),
        "seed": cfg.run.seed,
        "checkpoint_every_steps": cfg.run.checkpoint_every_steps,
    }


def _check_temperature(temperature: float, trainer: dict, scoring: float) -> None:
    """rollout.temperature trains (in (0, 2]) and trainer.temperature, where set, is the one the engines' log-probs
    are at (`scoring`)."""
    if temperature == 0:
        raise UserError(
            "rollout.temperature 0 (greedy) cannot train: PPO's ratios need the probabilities the engines sampled "
            "from; set rollout.temperature > 0 (e.g. 1.0)"
        )
    if not 0 < temperature <= 2:  # also refuses NaN
        raise UserError(f"rollout.temperature must be in (0, 2], got {temperature}")
    if "temperature" in trainer and trainer["temperature"] != scoring:
        source = "rollout.temperature" if scoring == temperature else "engine.logprobs_mode raw's temperature"
        raise UserError(
            f"trainer.temperature {trainer['temperature']!r} differs from {source} {scoring!r}: the trainer scores "
            "tokens at the temperature of the engines' log-probs, set from rollout.temperature and "
            "engine.logprobs_mode (leave trainer.temperature out)"
        )


def _section_error(section: str, message: str) -> UserError:
    """A config section's error, prefixed with the section's name unless the message already names its key."""
    return UserError(message if message.startswith(f"{section}.") else f"{section}: {message}")


def _check_gpus(r: ResourcesSection) -> None:
    """GPUs per resource: none, or a whole engine within one node of a known device type."""
    if r.gpus_per_resource < 0:
        raise UserError(f"resources.gpus_per_resource must be >= 0 (0: CPU cores only), got {r.gpus_per_resource}")
    if not r.gpus_per_resource:
        return
    if r.gpu is None:
        raise UserError("resources.gpus_per_resource > 0 needs resources.gpu: a device name (h800, h100, ...) or file")
    from core import specs

    try:
        node = specs.device(r.gpu).gpus_per_node
    except UserError as e:
        raise UserError(f"resources.gpu: {e}") from None
    if node % r.gpus_per_resource:
        raise UserError(
            f"resources.gpus_per_resource={r.gpus_per_resource} must divide the {node} GPUs of a "
            f"{r.gpu} node: a resource's engine is tensor parallel within one node"
        )


def load_train_config(
    path: str | Path | Sequence[str | Path] | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    """train.yaml, then each file of `config_files(path, overrides)` merged over it (later ones win), then
    `overrides`."""
    data = load_yaml(DEFAULT_CONFIG)
    for one in config_files(path, overrides):
        data = merge(data, load_yaml(one))
    data = apply_overrides(data, overrides or [])
    return from_dict(TrainConfig, data)


def config_files(path: str | Path | Sequence[str | Path] | None, overrides: list[str] | None = None) -> list[Path]:
    """The files merged over train.yaml, in order: the given ones; first, a task's own recipe (`TASK_DEFAULTS`)
    when the task is named only on the command line (`--task swe`, `--set task.name=swe`): train.yaml's values
    are the math task's, not a SWE run's. A file that names its task is a recipe of its own over train.yaml."""
    files = [Path(p) for p in ([path] if isinstance(path, str | Path) else path or ())]
    named_by_file = False
    for one in files:
        task = load_yaml(one).get("task")
        named_by_file |= isinstance(task, dict) and "name" in task
    if named_by_file:
        return files
    chosen = apply_overrides({"task": {"name": None}}, [o for o in overrides or () if _sets_task(o)])["task"]
    recipe = TASK_DEFAULTS.get(chosen.get("name") if isinstance(chosen, dict) else None)
    return files if recipe is None else [recipe, *files]


def _sets_task(override: str) -> bool:
    return override.split("=", 1)[0].strip() in ("task", "task.name")


def check_feasible(cfg: TrainConfig, cores: int | None = None) -> None:
    """What cannot run with these resources, as one clear line (UserError)."""
    have = len(os.sched_getaffinity(0)) if cores is None else cores
    need = cfg.resources.count * cfg.resources.cores_per_resource
    if cfg.run.ray_address is None and need > have:
        raise UserError(
            f"{cfg.resources.count} resources x {cfg.resources.cores_per_resource} cores need "
            f"{need} cores; this machine has {have} (lower resources.count or "
            f"resources.cores_per_resource)"
        )
    if cfg.policy.name != "colocated" and cfg.resources.count < 2:
        raise UserError(
            f"policy {cfg.policy.name!r} needs separate rollout and train resources: resources.count "
            f"must be >= 2, got {cfg.resources.count}"
        )
