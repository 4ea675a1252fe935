"""Describe a task: examples, the split, and what a random policy scores.

    python -m reference.tasks [math|throughput|swe|package.module:Class] [--samples 2000] [--seed 0]

The random policy draws every completion token uniformly from the task tokenizer's vocabulary; it
scores a little below `chance_reward()` (see there). (The untrained model's reward is printed by
`python -m reference.trainer.probe`.) Only a task graded one completion at a time (`grade(problem,
completion)`, as `SingleTurn` tasks are) has a random-policy reward here; an agent task's episodes are graded
where they run (the SWE task's in sandboxes: `python -m swebench_env eval`). `chance_reward()` and
`best_constant_reward()` are printed when the task defines them.
"""

from __future__ import annotations

import argparse
import random
import sys

from core.cli import run_main
from reference.tasks import TASKS, make_task


def random_policy_reward(task, rng: random.Random, samples: int) -> tuple[float, float]:
    """(mean reward, exact-match rate) of uniformly random tokens on the held-out problems."""
    tok, problems = task.tokenizer, task.held_out()
    rewards, exact = 0.0, 0
    for i in range(samples):
        problem = problems[i % len(problems)]
        length = problem.max_tokens or task.max_tokens
        grade = task.grade(problem, tok.decode([rng.randrange(tok.vocab_size) for _ in range(length)]))
        rewards, exact = rewards + grade.reward, exact + grade.exact
    return rewards / samples, exact / samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference.tasks", description=__doc__.splitlines()[0])
    parser.add_argument("task", nargs="?", default="math", help=f"one of {sorted(TASKS)}, or package.module:Class")
    parser.add_argument("--samples", type=int, default=2000, help="random completions to grade (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    try:
        task = make_task(args.task)
    except ValueError as e:  # an unknown name, a class that cannot be imported: the user's to fix
        parser.error(str(e))
    try:
        return describe(task, args.samples, args.seed)
    finally:
        if (close := getattr(task, "close", None)) is not None:
            close()


def describe(task, samples: int, seed: int) -> int:
    rng = random.Random(seed)
    for p in task.sample_train(rng, 3):
        shown = (
            f"{p.prompt[:300]!r} -> {p.answer[:300]!r}" if p.prompt else f"{p.problem_id} (the agent writes the prompt)"
        )
        print(f"example: {shown}")
    print(f"vocabulary {task.tokenizer.vocab_size} tokens, completions of up to {task.max_tokens} tokens")
    print(f"held-out evaluation problems: {len(task.held_out())}")
    if not callable(getattr(task, "grade", None)):
        print(
            f"random-policy reward: not measured here: {type(task).__name__} grades whole episodes where they run, "
            "not one completion (grade(problem, completion))"
        )
        return 0
    reward, exact = random_policy_reward(task, rng, samples)
    extras = [
        f"{label} {method():.3f}"
        for label, name in (("chance", "chance_reward"), ("best constant answer", "best_constant_reward"))
        if callable(method := getattr(task, name, None))
    ]
    print("; ".join([f"random-policy reward {reward:.3f} (exact {exact:.4f})", *extras]))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
