"""Recipe 4: a task of your own for the runtime: reverse a short digit string.

Prompt `3907>`, answer `7093`: the digits of the prompt in reverse order. Graded by code: the reward is the
share of answer positions right (dense, so a random policy gets a signal), `exact` whether all are.

Train on it by naming the class as `package.module:Class`, from the repository root (so that `examples` is
importable, in the driver and in every Ray worker):

    python -m reference train --task examples.reverse_task:ReverseTask --set task.options.digits=3
    python -m reference train --config examples/reverse-task.yaml

What a task provides (`reference/tasks/base.py`; `reference/tasks/math.py` is the full-size example):

- `name`, `tokenizer` (what the fresh tiny model's vocabulary is built from; the arithmetic tasks' character
  tokenizer has digits, `+-*=>`, space and newline, one token each) and `max_tokens` (tokens generated a sample);
- `sample_train(rng, n)`: n training problems; `held_out()`: a fixed list the run never trains on, the same in
  every process (workers rebuild the task from `task.name` and `task.options` to evaluate);
- `grade(problem, completion) -> Grade(reward in [0, 1], exact)`. `SingleTurn` supplies `episodes`: one
  `/completions` request of `n` samples a problem, each graded.

`python -m reference.tasks examples.reverse_task:ReverseTask` prints examples, the held-out size and what a
random policy scores (with the optional `chance_reward` and `best_constant_reward` at the end).

`task.options` (a config's mapping, or `--set task.options.KEY=VALUE`) are passed to the constructor as keyword
arguments; a bad one is one `error: task: ...` line before anything starts.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from functools import cached_property

from reference.tasks import Grade, Problem, SingleTurn
from reference.tasks.tokenizer import task_tokenizer
from reference.tokenizer import Tokenizer


@dataclass(frozen=True)
class ReverseConfig:
    digits: int = 3  # length of the string to reverse, and of the answer; 2..8
    held_out_percent: int = 20  # share of all strings never trained on (a stable hash of the prompt)
    split_salt: str = "reverse-v1"  # changes which strings are held out

    def __post_init__(self) -> None:
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 2 <= self.digits <= 8:
            raise ValueError(f"digits must be an integer in [2, 8], got {self.digits!r}")
        if not 1 <= self.held_out_percent <= 50:
            raise ValueError(f"held_out_percent must be in [1, 50], got {self.held_out_percent!r}")


class ReverseTask(SingleTurn):
    """See the module docstring. `ReverseTask(digits=4)` overrides `ReverseConfig` fields."""

    name = "reverse"

    def __init__(self, **options) -> None:
        self.config = ReverseConfig(**options)

    @property
    def tokenizer(self) -> Tokenizer:
        return task_tokenizer()

    @property
    def max_tokens(self) -> int:
        return self.config.digits

    def problem(self, digits: str) -> Problem:
        """The problem `digits>` (a string of the configured length)."""
        if len(digits) != self.config.digits or not digits.isdigit():
            raise ValueError(f"need {self.config.digits} digits, got {digits!r}")
        # ignore_eos: every sample is exactly the answer's length (a stop token is a wrong digit, as in math)
        return Problem(problem_id=f"rev-{digits}", prompt=f"{digits}>", answer=digits[::-1], ignore_eos=True)

    def is_held_out(self, problem: Problem) -> bool:
        key = f"{self.config.split_salt}:{problem.prompt}".encode()
        return zlib.crc32(key) % 100 < self.config.held_out_percent

    def _draw(self, rng: random.Random) -> Problem:
        return self.problem("".join(rng.choice("0123456789") for _ in range(self.config.digits)))

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        """`n` problems from the training split (independent draws; repeats are possible)."""
        out: list[Problem] = []
        while len(out) < n:
            p = self._draw(rng)
            if not self.is_held_out(p):
                out.append(p)
        return out

    @cached_property
    def _held_out(self) -> tuple[Problem, ...]:
        size = min(128, 10**self.config.digits * self.config.held_out_percent // 200)  # at most half of them
        rng, seen = random.Random(self.config.split_salt), {}
        while len(seen) < size:
            p = self._draw(rng)
            if self.is_held_out(p):
                seen.setdefault(p.prompt, p)
        return tuple(seen.values())

    def held_out(self) -> list[Problem]:
        """The fixed held-out evaluation problems (the same list in every process)."""
        return list(self._held_out)

    def grade(self, problem: Problem, completion: str) -> Grade:
        """The share of answer positions right; characters past the answer's length are ignored."""
        answer = problem.answer
        right = sum(1 for i, ch in enumerate(answer) if i < len(completion) and completion[i] == ch)
        return Grade(reward=right / len(answer), exact=right == len(answer))

    # Optional: what `python -m reference.tasks examples.reverse_task:ReverseTask` prints beside a random policy's
    # reward (training does not need them).
    def chance_reward(self) -> float:
        """A token drawn uniformly from the vocabulary is the right digit with this chance."""
        return 1.0 / self.tokenizer.vocab_size

    def best_constant_reward(self) -> float:
        """The best reward one fixed completion gets on the held-out problems (over all strings 0.1: no digit
        is likelier than another at any position; a little more on a sample of 100)."""
        problems = self.held_out()
        best = 0
        for i in range(self.max_tokens):
            counts: dict[str, int] = {}
            for p in problems:
                counts[p.answer[i]] = counts.get(p.answer[i], 0) + 1
            best += max(counts.values())
        return best / (len(problems) * self.max_tokens)
