"""Where a run's pieces go: the initial weights (policy version 0) and one worker per resource with its cores.

With no `model.dir`, a fresh tiny Qwen3 for the task (its small vocabulary, the config's size) is written
as version 0 of the weight hand-off directory, so engines and trainer shards start from the same bytes.
With `model.dir`, that checkpoint is version 0 as it is. Resource i owns cores [i*c, (i+1)*c) of the
cores this process may use (c = `resources.cores_per_resource`).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file
from transformers import Qwen3Config

from core.errors import UserError
from core.policies import BasePolicy
from core.tags import Tag
from reference.control.config import TrainConfig
from reference.control.worker import WorkerSpec
from reference.model import build_model, tiny_config
from reference.rollout.groups import GroupResult, untrained_groups
from reference.tasks.base import Task
from reference.tokenizer import Tokenizer
from reference.trainer.handoff import WEIGHTS_FILE, publish_weights, version_dir


def initial_weights(cfg: TrainConfig, task: Task, root: Path) -> str:
    """The checkpoint directory every engine and trainer shard starts from (policy version 0)."""
    if cfg.model.dir is not None:
        return str(Path(cfg.model.dir).resolve())
    config = model_config(cfg, task)
    model = build_model(config, seed=cfg.model.init_seed)
    return str(publish_weights(model.state_dict(), config, root, 0, task.tokenizer).path.resolve())


def model_config(cfg: TrainConfig, task: Task):
    """The fresh model's configuration (`model` section), over the task's tokenizer and context."""
    m = cfg.model
    return tiny_config(
        task.tokenizer.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        intermediate_size=m.intermediate_size,
        initializer_range=m.initializer_range,
        max_position_embeddings=task_context(task),
    )


def task_context(task: Task) -> int:
    """Positions the model needs: what the task says (`context_tokens`: an agent's whole conversation), else
    the longest held-out prompt and its answer, with room to spare."""
    if (declared := getattr(task, "context_tokens", None)) is not None:
        return declared
    longest = max(len(task.tokenizer.encode(p.prompt)) for p in task.held_out())
    return max(64, 2 * (longest + task.max_tokens))


@dataclass(frozen=True)
class Checkpoint:
    step: int  # steps it holds (the policy version of its weights)
    path: Path


def last_checkpoint(out: Path, num_steps: int) -> Checkpoint:
    """The newest trainer checkpoint of the run in `out` (UserError if there is none to resume from)."""
    found = sorted((out / "checkpoints").glob("step-*"))
    if not found:
        raise UserError(
            f"nothing to resume in {str(out)!r}: no checkpoint under checkpoints/ (set "
            f"run.checkpoint_every_steps when starting a run)"
        )
    step = int(found[-1].name.removeprefix("step-"))
    if step >= num_steps:
        raise UserError(f"the run in {str(out)!r} already trained its {num_steps} steps")
    return Checkpoint(step, found[-1])


def resumed_weights(cfg: TrainConfig, task: Task, root: Path, checkpoint: Checkpoint) -> str:
    """The version directory a resumed run starts from: the one its run published for the checkpoint's step, or,
    where the run was killed after its trainer wrote the checkpoint and before that version was published, one
    published now from the checkpoint's weights (with the run's tokenizer: the model's own, or the task's)."""
    target = version_dir(root, checkpoint.step)
    if not target.is_dir():
        config = Qwen3Config.from_json_file(str(checkpoint.path / "config.json"))
        state = load_file(str(checkpoint.path / WEIGHTS_FILE))
        tokenizer = Tokenizer.load(cfg.model.dir) if cfg.model.dir is not None else task.tokenizer
        publish_weights(state, config, root, checkpoint.step, tokenizer)
    return str(target)


def ships_initial_weights(cfg: TrainConfig, model_dir: str) -> bool:
    """Whether the workers get the initial weights through the object store (`engine.weights_transport:
    object_store`, where they may not see this machine's files): where the run wrote them itself (a fresh model,
    a warm start, a resumed version). A `model.dir` checkpoint is read where it is, as vLLM reads a model: each
    node must have it at that path."""
    if cfg.engine.weights_transport != "object_store":
        return False
    return cfg.model.dir is None or Path(model_dir).resolve() != Path(cfg.model.dir).resolve()


async def resumed(manager, step: int, weights: str | dict[str, str]) -> list[GroupResult]:
    """A resumed run's manager state: every engine holds policy version `step` (they start from its weights
    but label tokens 0), and the groups that no kept step consumed are released for adoption. `weights`: the
    version's directory, or each engine's own copy of it."""
    await manager.pause()
    await manager.update_weights(step, weights)
    await manager.resume()
    await asyncio.to_thread(manager.store.release_consumed, step)
    return await asyncio.to_thread(untrained_groups, manager.store)


def worker_specs(cfg: TrainConfig, policy: BasePolicy, model_dir: str) -> list[WorkerSpec]:
    """One worker a resource. On a local Ray each is pinned to its own `cores_per_resource` cores of this process's;
    on a cluster it joined (`run.ray_address`) the cores are the nodes', so each asks Ray for that many CPUs and
    runs as many threads, unpinned."""
    cores = sorted(os.sched_getaffinity(0)) if cfg.run.ray_address is None else []
    c = cfg.resources.cores_per_resource
    specs = []
    for i, r in enumerate(policy.resources.values()):
        mine = tuple(cores[i * c : (i + 1) * c]) if cores else ()
        tags = tuple(t.value for t in (Tag.ROLLOUT, Tag.TRAIN) if r.can(t))
        specs.append(
            WorkerSpec(
                r.name,
                tags,
                mine,
                model_dir,
                cfg.run.seed + i,
                cfg.engine.max_batch,
                cfg.engine.backend,
                cfg.engine.coalesce_s,
                cfg.engine.weights_local_root,
                num_threads=0 if cores else c,
                logprobs_mode=cfg.engine.logprobs_mode,
            )
        )
    return specs
