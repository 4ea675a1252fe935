"""Describe a task: examples, the split, and what a random policy scores.

    python -m reference.tasks [math|throughput] [--samples 2000] [--seed 0]

The random policy draws every completion token uniformly from the task tokenizer's vocabulary; it
scores a little below `chance_reward()` (see there). (The untrained model's reward is printed by
`python -m reference.trainer.probe`.)
"""

from __future__ import annotations

import argparse
import random

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", nargs="?", default="math", help=f"one of {sorted(TASKS)}")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    task = make_task(args.task)
    rng = random.Random(args.seed)
    for p in task.sample_train(rng, 3):
        print(f"example: {p.prompt!r} -> {p.answer!r}")
    print(f"vocabulary {task.tokenizer.vocab_size} tokens, completions of up to {task.max_tokens} tokens")
    print(f"held-out evaluation problems: {len(task.held_out())}")
    reward, exact = random_policy_reward(task, rng, args.samples)
    print(
        f"random-policy reward {reward:.3f} (exact {exact:.4f}); chance {task.chance_reward():.3f}; "
        f"best constant answer {task.best_constant_reward():.3f}"
    )


if __name__ == "__main__":
    main()
