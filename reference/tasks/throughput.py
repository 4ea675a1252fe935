"""The `throughput` task: a workload, not something to learn, whose response lengths have the simulator's long tail.

Each problem forces its response length. Both its prompt length and its response length are drawn
from the simulator's capped log-normal (`sim.config.Dist`, drawn as `sim.workload.draw_int` does):
`median * exp(sigma * N(0, 1))`, clipped to [min, max], rounded, at least 1. The defaults are the
simulator's paper-like math workload (`sim/configs/default.yaml`) with every token count divided by 64,
so that it runs on this CPU:

| option | default | sim/configs/default.yaml |
| --- | --- | --- |
| `response_median_tokens`, `response_sigma` | 39, 0.8 | `response_tokens` median 2500, sigma 0.8 |
| `response_min_tokens`, `response_max_tokens` | 1, 256 | `response_tokens` min 16, max 16384 |
| `prompt_median_tokens`, `prompt_sigma` | 6, 0.4 | `prompt_tokens` median 400, sigma 0.4 |
| `prompt_min_tokens`, `prompt_max_tokens` | 1, 32 | `prompt_tokens` min 32, max 2048 |

A response then has a mean of about 53 tokens (median 39) and the longest responses are about 6.5 times
the median: the stragglers that keep a synchronous step waiting. The lengths are a pure function of
the problem (seeded by `salt` and the problem's 64-bit key), so a run is reproducible, and the same in
every process.

In the simulator: `response_<field>` is `workload.response_tokens.<field>` and `prompt_<field>` is
`workload.prompt_tokens.<field>` (median, sigma, min, max; `simulator_workload()` gives that section),
with `workload.kind: math`; the runtime's `rollout.prompts_per_step` and `rollout.group_size` are
`workload.prompts_per_step` and `workload.group_size`. The rollout manager sends a group as one request
with one `max_tokens`, so the samples of a group share their problem's length (the spread is between
groups, not within one): `workload.shared_response: true` in the simulator, which `simulator_workload()`
sets.

Forcing: every problem carries its `max_tokens` and `ignore_eos`, so the trajectory manager treats the
stop tokens as ordinary tokens and each sample is exactly its length (its text keeps them). Prompts are
digit strings of the drawn length in the arithmetic tasks' character tokenizer (one token a character),
which also makes grading exact: the text of any sampled ids encodes back to as many tokens.

Reward: 1.0 when the completion has the forced length, else 0.0. It is a sanity check that the lengths
were forced end to end, not something to learn: the policy cannot change it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import cached_property

from reference.tasks.base import Grade, Problem, SingleTurn
from reference.tasks.tokenizer import task_tokenizer
from reference.tokenizer import Tokenizer

MAX_LENGTH_TOKENS = 1 << 16  # a sanity bound on any configured length


@dataclass(frozen=True)
class ThroughputConfig:
    response_median_tokens: float = 39.0  # sim: workload.response_tokens.median (2500 / 64)
    response_sigma: float = 0.8  # sim: workload.response_tokens.sigma
    response_min_tokens: int = 1  # sim: workload.response_tokens.min (16 / 64, at least 1)
    response_max_tokens: int = 256  # sim: workload.response_tokens.max (16384 / 64); also the task's max_tokens
    prompt_median_tokens: float = 6.0  # sim: workload.prompt_tokens.median (400 / 64)
    prompt_sigma: float = 0.4  # sim: workload.prompt_tokens.sigma
    prompt_min_tokens: int = 1  # sim: workload.prompt_tokens.min (32 / 64, at least 1)
    prompt_max_tokens: int = 32  # sim: workload.prompt_tokens.max (2048 / 64)
    held_out_size: int = 8  # problems in the fixed evaluation list
    salt: str = "throughput-v1"  # seeds every problem's lengths and digits

    def __post_init__(self) -> None:
        for part in ("response", "prompt"):
            self._check_dist(part)
        if self.prompt_max_tokens > self.response_max_tokens:
            raise ValueError(
                f"prompt_max_tokens ({self.prompt_max_tokens}) must be <= response_max_tokens "
                f"({self.response_max_tokens}): the model's context is sized from the latter"
            )
        if not isinstance(self.held_out_size, int) or not 1 <= self.held_out_size <= 1024:
            raise ValueError(f"held_out_size must be an integer in [1, 1024], got {self.held_out_size!r}")
        if not isinstance(self.salt, str):
            raise ValueError(f"salt must be a string, got {self.salt!r}")

    def _check_dist(self, part: str) -> None:
        median, sigma = getattr(self, f"{part}_median_tokens"), getattr(self, f"{part}_sigma")
        lo, hi = getattr(self, f"{part}_min_tokens"), getattr(self, f"{part}_max_tokens")
        for name, value in ((f"{part}_min_tokens", lo), (f"{part}_max_tokens", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LENGTH_TOKENS:
                raise ValueError(f"{name} must be an integer in [1, {MAX_LENGTH_TOKENS}], got {value!r}")
        for name, value in ((f"{part}_median_tokens", median), (f"{part}_sigma", sigma)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if sigma < 0 or not lo <= median <= hi:
            raise ValueError(
                f"{part} lengths need sigma >= 0 and {part}_min_tokens <= {part}_median_tokens <= "
                f"{part}_max_tokens, got sigma {sigma}, min {lo}, median {median}, max {hi}"
            )

    def dist(self, part: str) -> dict:
        """The simulator's `Dist` fields of `part` ("prompt" or "response")."""
        return {
            "median": float(getattr(self, f"{part}_median_tokens")),
            "sigma": float(getattr(self, f"{part}_sigma")),
            "min": getattr(self, f"{part}_min_tokens"),
            "max": getattr(self, f"{part}_max_tokens"),
        }


def draw_tokens(dist: dict, rng: random.Random) -> int:
    """A length in tokens, drawn exactly as the simulator's `draw_int` draws from a `Dist` (same rng calls)."""
    value = dist["median"] * math.exp(dist["sigma"] * rng.gauss(0.0, 1.0)) if dist["sigma"] else dist["median"]
    return max(1, round(min(dist["max"], max(dist["min"], value))))


class ThroughputTask(SingleTurn):
    """See the module docstring. `ThroughputTask(response_median_tokens=20)` etc. override `ThroughputConfig`."""

    name = "throughput"

    def __init__(self, config: ThroughputConfig | None = None, **overrides) -> None:
        if config is not None and overrides:
            raise ValueError(f"pass a ThroughputConfig or field overrides, not both (got {sorted(overrides)})")
        self.config = config if config is not None else ThroughputConfig(**overrides)

    @property
    def tokenizer(self) -> Tokenizer:
        return task_tokenizer()

    @property
    def max_tokens(self) -> int:
        """The longest response (each problem names its own length, up to this)."""
        return self.config.response_max_tokens

    def problem(self, key: int) -> Problem:
        """The problem with this 64-bit key: a prompt of its drawn length, and its forced response length."""
        rng = random.Random(f"{self.config.salt}:{key}")
        prompt_tokens = draw_tokens(self.config.dist("prompt"), rng)
        length = draw_tokens(self.config.dist("response"), rng)
        prompt = "".join(rng.choice("0123456789") for _ in range(prompt_tokens))
        return Problem(f"tp-{key:016x}", prompt, answer=str(length), max_tokens=length, ignore_eos=True)

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        """`n` fresh problems (random 64-bit keys: one of the held-out keys comes up with chance ~2**-61)."""
        return [self.problem(rng.getrandbits(64)) for _ in range(n)]

    @cached_property
    def _held_out(self) -> tuple[Problem, ...]:
        rng = random.Random(f"{self.config.salt}:held-out")
        return tuple(self.problem(rng.getrandbits(64)) for _ in range(self.config.held_out_size))

    def held_out(self) -> list[Problem]:
        """The fixed evaluation problems (the same list in every process)."""
        return list(self._held_out)

    def grade(self, problem: Problem, completion: str) -> Grade:
        """1.0 when the completion is exactly the problem's forced length in tokens, else 0.0: a check that
        lengths were forced end to end (the workload measures throughput; there is nothing to learn)."""
        try:
            tokens = len(self.tokenizer.encode(completion))
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception for text outside the alphabet
            return Grade(reward=0.0, exact=False)
        exact = tokens == problem.max_tokens
        return Grade(reward=float(exact), exact=exact)

    def simulator_workload(self) -> dict:
        """The simulator's `workload` keys this task fixes (merge over a sim config; group sizes come from
        the runtime's rollout section)."""
        return {
            "kind": "math",
            "prompt_tokens": self.config.dist("prompt"),
            "response_tokens": self.config.dist("response"),
            "shared_response": True,
        }

    def chance_reward(self) -> float:
        """A uniformly random policy's reward: 1.0, since every forced completion has the right length."""
        return 1.0

    def best_constant_reward(self) -> float:
        """The best reward one fixed completion gets on the held-out problems: the share of the most common
        length among them."""
        lengths = [p.max_tokens for p in self.held_out()]
        return max(lengths.count(n) for n in set(lengths)) / len(lengths)
