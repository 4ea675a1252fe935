"""Learnability probe: GRPO on a task in one process, no servers, from a randomly initialised model.

Each step draws `prompts_per_step` training problems, samples `group_size` completions of exactly
`task.max_tokens` tokens for each with plain torch (at the trainer's `temperature`, 1 by default; a KV cache;
logprobs of the distribution sampled from, recorded at sampling time: the behaviour policy), grades them, and takes
one `Trainer.train_step`. It prints the random policy's reward (the untrained model on the held-out problems, beside
chance and the best constant answer), then per step the training reward and, every `eval_every_steps`, the held-out
reward (one sample per held-out problem, at the same temperature) and exact-match rate.

The target is reached when the mean training reward of the last `WINDOW` steps is >= `target_reward`.
Held-out evaluation draws from its own generator (seeded by seed and step), so evaluating does not
change the training run.

    python -m reference.trainer.probe --seed 0 [--max-seconds 300] [--target 0.8] [--keep-going]
                                      [--lag 1] [--init-seed 0] [--set lr=6e-4]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from core.cli import at_least, greater_than, in_range
from reference.model import build_model
from reference.tasks import Problem, Task, make_task
from reference.trainer.batch import Trajectory
from reference.trainer.config import TrainerConfig
from reference.trainer.recipe import MathRecipe
from reference.trainer.trainer import Trainer

WINDOW = 5  # steps averaged for the target test


@torch.no_grad()
def sample_tokens(
    model, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, N], logprobs [B, N]) sampled from softmax(logits / temperature) after equal-length prompts [B, P];
    the logprobs are of that distribution (what the trainer at `temperature` scores)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (a sampled distribution), got {temperature!r}")
    out = model(input_ids=prompt_ids, use_cache=True)
    # The KV cache's name: `cache` from transformers 5.24 (argument and output), `past_key_values` before.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, logprobs = [], []
    for i in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        logp = torch.log_softmax(logits / temperature if temperature != 1 else logits, dim=-1)  # [B, V]
        token = torch.multinomial(logp.exp(), 1, generator=generator)  # [B, 1]
        tokens.append(token)
        logprobs.append(logp.gather(-1, token))
        if i + 1 < max_new_tokens:
            out = model(input_ids=token, use_cache=True, **{name: getattr(out, name)})
    return torch.cat(tokens, dim=1), torch.cat(logprobs, dim=1)


def complete(model, task: Task, problems: Sequence[Problem], generator: torch.Generator, temperature: float = 1.0):
    """(prompt ids [B, P], tokens [B, N], logprobs [B, N], grades) for one completion per problem."""
    tok = task.tokenizer
    prompts = torch.tensor([tok.encode(p.prompt) for p in problems], dtype=torch.long)
    tokens, logprobs = sample_tokens(model, prompts, task.max_tokens, generator, temperature)
    grades = [task.grade(p, tok.decode(row)) for p, row in zip(problems, tokens.tolist(), strict=True)]
    return prompts, tokens, logprobs, grades


def rollout(
    trainer: Trainer,
    task: Task,
    problems: Sequence[Problem],
    group_size: int,
    behaviour=None,
    version: int | None = None,
) -> list[Trajectory]:
    """`group_size` graded samples of each problem from the trainer's current weights (or from `behaviour`,
    a model holding policy `version`), as trajectories."""
    batch = [p for p in problems for _ in range(group_size)]
    model = trainer.model if behaviour is None else behaviour
    was_training = model.training
    model.eval()
    prompts, tokens, logprobs, grades = complete(model, task, batch, trainer.generator, trainer.config.temperature)
    model.train(was_training)
    mask = (0,) * prompts.shape[1] + (1,) * tokens.shape[1]
    versions = (trainer.version if version is None else version,) * tokens.shape[1]
    rows = zip(batch, prompts.tolist(), tokens.tolist(), logprobs.tolist(), grades, strict=True)
    return [Trajectory((*p, *t), mask, lp, versions, problem.problem_id, g.reward) for problem, p, t, lp, g in rows]


def evaluate(model, task: Task, generator: torch.Generator, temperature: float = 1.0) -> tuple[float, float]:
    """(mean reward, exact-match rate) of one sample at `temperature` per held-out problem."""
    was_training = model.training
    model.eval()
    *_, grades = complete(model, task, task.held_out(), generator, temperature)
    model.train(was_training)
    return _mean([g.reward for g in grades]), _mean([float(g.exact) for g in grades])


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


@dataclass(frozen=True)
class ProbeResult:
    seed: int
    random_policy_reward: float  # the untrained model on the held-out problems
    chance_reward: float  # uniform tokens over the vocabulary
    best_constant_reward: float
    steps: int
    seconds: float
    seconds_to_target: float | None  # None: the target was not reached
    train_reward: float  # mean of the last WINDOW steps
    held_out_reward: float  # at the end
    held_out_exact: float


def run_probe(
    recipe: MathRecipe,
    seed: int,
    *,
    max_seconds: float = 300.0,
    max_steps: int = 10_000,
    target_reward: float = 0.8,
    eval_every_steps: int = 20,
    stop_at_target: bool = True,
    lag: int = 0,
    init_seed: int | None = None,
    log: Callable[[str], None] = print,
) -> ProbeResult:
    """Train from a random init until the target, `max_seconds` or `max_steps` (see module docstring).
    `lag` > 0 samples every batch from the weights of `lag` steps before (an off-policy pipeline's worst
    case: every token `lag` versions stale); `init_seed` seeds the init apart from the run (default: seed)."""
    task = make_task(recipe.task)
    tok = task.tokenizer
    model = build_model(recipe.model_config(tok.vocab_size), seed=seed if init_seed is None else init_seed)
    snapshots: deque[dict] = deque(maxlen=lag + 1)  # policy versions step-lag .. step
    behaviour = copy.deepcopy(model) if lag else None
    trainer = Trainer(model, replace(recipe.trainer, seed=seed), pad_id=tok.pad_token_id)
    temperature = recipe.trainer.temperature  # rollouts and evaluations alike
    random_reward, _ = evaluate(model, task, _eval_generator(seed, 0), temperature)
    log(
        f"seed {seed}: random-policy reward {random_reward:.3f} (held-out), chance {task.chance_reward():.3f}, "
        f"best constant {task.best_constant_reward():.3f}"
    )
    rewards: list[float] = []
    start, reached = time.perf_counter(), None
    while trainer.step < max_steps and time.perf_counter() - start < max_seconds:
        problems = task.sample_train(trainer.rng, recipe.prompts_per_step)
        if lag:
            snapshots.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
            behaviour.load_state_dict(snapshots[0])  # the oldest kept: version max(0, step - lag)
            old = max(0, trainer.version - lag)
            metrics = trainer.train_step(rollout(trainer, task, problems, recipe.group_size, behaviour, old))
        else:
            metrics = trainer.train_step(rollout(trainer, task, problems, recipe.group_size))
        rewards.append(metrics.reward_mean)
        elapsed, recent = time.perf_counter() - start, _mean(rewards[-WINDOW:])
        line = f"step {trainer.step:4d} {elapsed:6.1f}s train {metrics.reward_mean:.3f} entropy {metrics.entropy:.3f}"
        if reached is None and len(rewards) >= WINDOW and recent >= target_reward:
            reached = elapsed
        if trainer.step % eval_every_steps == 0 or (reached is not None and stop_at_target):
            held, exact = evaluate(trainer.model, task, _eval_generator(seed, trainer.step), temperature)
            line += f" held-out {held:.3f} exact {exact:.3f}"
        log(line)
        if reached is not None and stop_at_target:
            break
    held, exact = evaluate(trainer.model, task, _eval_generator(seed, trainer.step), temperature)
    return ProbeResult(
        seed=seed,
        random_policy_reward=random_reward,
        chance_reward=task.chance_reward(),
        best_constant_reward=task.best_constant_reward(),
        steps=trainer.step,
        seconds=time.perf_counter() - start,
        seconds_to_target=reached,
        train_reward=_mean(rewards[-WINDOW:]) if rewards else float("nan"),
        held_out_reward=held,
        held_out_exact=exact,
    )


def _eval_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def _field(parser: argparse.ArgumentParser, item: str) -> tuple[str, object]:
    name, sep, text = item.partition("=")
    if not sep:
        parser.error(f"--set takes FIELD=VALUE, got {item!r}")
    try:
        return name, json.loads(text)
    except json.JSONDecodeError:
        return name, text


def main(argv: Sequence[str] | None = None) -> ProbeResult:
    parser = argparse.ArgumentParser(description="GRPO learnability probe (one process, random init)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=greater_than(0), default=300.0)
    parser.add_argument("--max-steps", type=at_least(1), default=10_000)
    parser.add_argument(
        "--target",
        type=in_range(float, 0, 1, low_open=True),
        default=0.8,
        help="mean training reward over the last steps",
    )
    parser.add_argument("--eval-every", type=at_least(1), default=20, help="steps between held-out evaluations")
    parser.add_argument("--keep-going", action="store_true", help="train on after the target until the limits")
    parser.add_argument("--lag", type=at_least(0), default=0, help="sample from the weights of this many steps before")
    parser.add_argument("--init-seed", type=int, default=None, help="seed of the random init (default: --seed)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a TrainerConfig field, e.g. --set lr=6e-4 (repeatable)",
    )
    args = parser.parse_args(argv)
    recipe = MathRecipe()
    if args.set:
        fields = dict(_field(parser, item) for item in args.set)
        try:
            recipe = replace(recipe, trainer=TrainerConfig.from_dict({**recipe.trainer.to_dict(), **fields}))
        except (TypeError, ValueError) as e:
            parser.error(str(e))
    result = run_probe(
        recipe,
        args.seed,
        max_seconds=args.max_seconds,
        max_steps=args.max_steps,
        target_reward=args.target,
        eval_every_steps=args.eval_every,
        stop_at_target=not args.keep_going,
        lag=args.lag,
        init_seed=args.init_seed,
    )
    to_target = "not reached" if result.seconds_to_target is None else f"{result.seconds_to_target:.1f} s"
    print(
        f"seed {result.seed}: target {args.target} {to_target}; {result.steps} steps in {result.seconds:.1f} s; "
        f"train {result.train_reward:.3f}, held-out {result.held_out_reward:.3f} "
        f"(exact {result.held_out_exact:.3f})"
    )
    return result


if __name__ == "__main__":
    main()
