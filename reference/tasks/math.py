"""The `math` task: add a one-digit number to every digit of A, modulo 10; graded by code.

A prompt is `A+B=` where A has `digits` digits and B is one digit drawn from `addends`; the answer has
`digits` digits, the i-th being (A_i + B) mod 10. Examples with the defaults (3 digits, B in {1, 2}):
`483+1=` -> `594`, `979+2=` -> `191`. Every character is one token of the task tokenizer, so the
completion is exactly `digits` tokens (`max_tokens`).

Why this task: each answer digit is uniform over 0-9 for a uniform prompt, so no constant answer
beats chance (0.1 a digit); each answer digit depends on two prompt positions (A_i and B); and the
held-out prompts are new combinations, so a memorising policy fails them. It is learnable by GRPO
from a random start on a 2-core CPU in under a minute of training (see `reference.trainer.probe`);
with all ten addends, or with carries, learning is several times slower (measured), which is why the
default draws B from {1, 2}; `addends="0123456789"` is the harder variant.

Reward: the fraction of answer positions right (dense; an exact-match reward gives a random policy
almost no signal); `exact` is the exact-match metric. Characters after the answer's length are
ignored; a missing character is wrong. The split is a stable hash of the prompt: `held_out_percent`
of all prompts are held out, and `held_out()` is a fixed sample of `held_out_size` of them.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from functools import cached_property

from reference.tasks.base import Grade, Problem, SingleTurn
from reference.tasks.tokenizer import task_tokenizer
from reference.tokenizer import Tokenizer


@dataclass(frozen=True)
class MathConfig:
    digits: int = 3  # digits of A and of the answer; 1..8
    addends: str = "12"  # the digits B is drawn from (distinct, in any order)
    held_out_percent: int = 20  # share of the prompt space never trained on; 1..50
    held_out_size: int | None = None  # problems in the fixed held-out list; None: 128, or fewer if the space is small
    split_salt: str = "math-v1"  # changes which prompts are held out

    def __post_init__(self) -> None:
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 8:
            raise ValueError(f"digits must be an integer in [1, 8], got {self.digits!r}")
        if not self.addends.isdigit() or len(set(self.addends)) != len(self.addends):
            raise ValueError(f"addends must be distinct digits, at least one, got {self.addends!r}")
        if not 1 <= self.held_out_percent <= 50:
            raise ValueError(f"held_out_percent must be in [1, 50], got {self.held_out_percent!r}")
        space = self.prompt_space * self.held_out_percent // 100
        if self.held_out_size is None:
            object.__setattr__(self, "held_out_size", max(1, min(128, space // 2)))
        if not 1 <= self.held_out_size <= space // 2:
            raise ValueError(
                f"held_out_size must be in [1, {space // 2}] (half the held-out prompts), got {self.held_out_size!r}"
            )

    @property
    def prompt_space(self) -> int:
        return 10**self.digits * len(self.addends)


class MathTask(SingleTurn):
    """See the module docstring. `MathTask(digits=4)` etc. override `MathConfig` fields."""

    name = "math"

    def __init__(self, config: MathConfig | None = None, **overrides) -> None:
        if config is not None and overrides:
            raise ValueError(f"pass a MathConfig or field overrides, not both (got {sorted(overrides)})")
        self.config = config if config is not None else MathConfig(**overrides)

    @property
    def tokenizer(self) -> Tokenizer:
        return task_tokenizer()

    @property
    def max_tokens(self) -> int:
        return self.config.digits

    def problem(self, a: str, b: str) -> Problem:
        """The problem `a+b=`: `a` has the configured number of digits, `b` is one of the addends."""
        c = self.config
        if len(a) != c.digits or not a.isdigit() or len(b) != 1 or b not in c.addends:
            raise ValueError(f"need a {c.digits}-digit A and B one of {c.addends!r}, got {a!r} and {b!r}")
        answer = "".join(str((int(x) + int(b)) % 10) for x in a)
        # ignore_eos: every sample is exactly the answer's length; a sampled stop token is a wrong digit, not
        # a shorter answer (as the probe samples, and so that one early stop does not end a group's signal).
        return Problem(problem_id=f"{a}+{b}", prompt=f"{a}+{b}=", answer=answer, ignore_eos=True)

    def is_held_out(self, problem: Problem) -> bool:
        key = f"{self.config.split_salt}:{problem.prompt}".encode()
        return zlib.crc32(key) % 100 < self.config.held_out_percent

    def _draw(self, rng: random.Random) -> Problem:
        c = self.config
        return self.problem("".join(rng.choice("0123456789") for _ in range(c.digits)), rng.choice(c.addends))

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        """`n` problems from the training split (independent draws; repeats are possible)."""
        out = []
        while len(out) < n:
            p = self._draw(rng)
            if not self.is_held_out(p):
                out.append(p)
        return out

    @cached_property
    def _held_out(self) -> tuple[Problem, ...]:
        rng, seen = random.Random(self.config.split_salt), {}
        while len(seen) < self.config.held_out_size:
            p = self._draw(rng)
            if self.is_held_out(p):
                seen.setdefault(p.prompt, p)
        return tuple(seen.values())

    def held_out(self) -> list[Problem]:
        """The fixed held-out evaluation problems (the same list in every process)."""
        return list(self._held_out)

    def grade(self, problem: Problem, completion: str) -> Grade:
        answer = problem.answer
        right = sum(1 for i, ch in enumerate(answer) if i < len(completion) and completion[i] == ch)
        return Grade(reward=right / len(answer), exact=right == len(answer))

    def chance_reward(self) -> float:
        """The chance that a token drawn uniformly from the vocabulary is the right digit. A uniformly
        random policy scores a little below it: a special token decodes to several characters and
        shifts the later ones out of place."""
        return 1.0 / self.tokenizer.vocab_size

    def best_constant_reward(self) -> float:
        """The best reward any single fixed completion gets on the held-out problems (chance level for
        digits, 0.1, when the task has no constant shortcut)."""
        problems = self.held_out()
        best = 0
        for i in range(self.max_tokens):
            counts: dict[str, int] = {}
            for p in problems:
                counts[p.answer[i]] = counts.get(p.answer[i], 0) + 1
            best += max(counts.values())
        return best / (len(problems) * self.max_tokens)
