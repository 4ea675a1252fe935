"""Workloads: GRPO prompt groups whose samples are sequences of engine requests.

`math`: one request per sample (prompt, then a long-tailed response capped at a maximum; with
`shared_response` one length per group, as the runtime's `throughput` task forces).
`swe`: an agent episode per sample: each turn is a request that appends a tool output to the
context and generates a reply; between turns the sample waits for its tool call in the sandbox, and
after the last turn for the test run that computes the reward. Lengths are drawn up front from a
seeded RNG, so a run is a pure function of its config. `SandboxStarts` times a SWE workload's container
starts from a seeded stream of its own.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from sim.config import Dist, WorkloadConfig


def draw(dist: Dist, rng: random.Random) -> float:
    """min(dist.max, max(dist.min, value)), written out (it runs millions of times a large run)."""
    value = dist.median * math.exp(dist.sigma * rng.gauss(0.0, 1.0)) if dist.sigma else dist.median
    if not value > dist.min:
        value = dist.min
    return value if value < dist.max else dist.max


def draw_int(dist: Dist, rng: random.Random) -> int:
    value = round(draw(dist, rng))
    return value if value > 1 else 1  # max(1, value)


@dataclass(frozen=True)
class Turn:
    input_tokens: int  # tokens appended to the context before this turn (the prompt, or a tool output)
    output_tokens: int  # tokens the model generates in this turn
    wait_s: float  # sandbox time after this turn (tool call, or the final test run)


@dataclass(eq=False)
class Sample:
    """One trajectory of a GRPO group, with its progress and the versions that produced it."""

    group_id: int
    index: int
    turns: tuple[Turn, ...]
    turn: int = 0
    context: int = 0  # tokens in context before the current turn's generation
    generated: int = 0  # tokens generated so far in the current turn
    version_tokens: dict[int, int] = field(default_factory=dict)
    engine: int | None = None  # affinity: engine that last served this sample (prefix cache)
    restarts: int = 0
    where: str = "queue"  # queue | engine | held | wait | done | pending (maintained by the simulator)
    sandbox_ready: float = 0.0  # when its workspace container has started (workload.sandbox_start_s)

    @property
    def current(self) -> Turn:
        return self.turns[self.turn]

    @property
    def remaining(self) -> int:
        return self.turns[self.turn].output_tokens - self.generated

    @property
    def prefix_tokens(self) -> int:
        """Tokens the engine must hold to continue this turn (input so far plus generated)."""
        return self.context + self.turns[self.turn].input_tokens + self.generated

    @property
    def final_context(self) -> int:
        """Context length when the current turn finishes (what KV admission reserves)."""
        turn = self.turns[self.turn]
        return self.context + turn.input_tokens + turn.output_tokens

    @property
    def total_tokens(self) -> int:
        return sum(t.input_tokens + t.output_tokens for t in self.turns)

    @property
    def generated_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    @property
    def min_version(self) -> int:
        return min(self.version_tokens) if self.version_tokens else 0

    def add_tokens(self, version: int, count: int) -> None:
        if count:
            self.generated += count
            self.version_tokens[version] = self.version_tokens.get(version, 0) + count

    def finish_turn(self) -> bool:
        """Close the current turn; True when the episode is over."""
        turn = self.turns[self.turn]
        self.context += turn.input_tokens + turn.output_tokens
        self.generated = 0
        self.turn += 1
        return self.turn >= len(self.turns)

    def restart(self, turns: tuple[Turn, ...]) -> int:
        """Throw away every generated token and sample a fresh trajectory for the same prompt
        (`turns`, drawn anew: sampling is random); returns the tokens lost."""
        lost = sum(self.version_tokens.values())
        self.turns, self.turn, self.context, self.generated, self.engine = turns, 0, 0, 0, None
        self.version_tokens = {}
        self.restarts += 1
        return lost


class Workload:
    """Makes prompt groups on demand, deterministically from the seed."""

    def __init__(self, cfg: WorkloadConfig, seed: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.next_group = 0

    @property
    def max_request_tokens(self) -> int:
        """Largest context one request can reach (for KV-capacity checks)."""
        c = self.cfg
        if c.kind == "math":
            return int(c.prompt_tokens.max + c.response_tokens.max)
        return c.max_context_tokens

    def new_group(self) -> list[Sample]:
        gid = self.next_group
        self.next_group += 1
        prompt = draw_int(self.cfg.prompt_tokens, self.rng)
        if self._shared:
            episode = self._episode(prompt)
            return [Sample(gid, i, episode) for i in range(self.cfg.group_size)]
        return [Sample(gid, i, self._episode(prompt)) for i in range(self.cfg.group_size)]

    @property
    def _shared(self) -> bool:
        return self.cfg.kind == "math" and self.cfg.shared_response

    def redraw(self, sample: Sample) -> tuple[Turn, ...]:
        """A new trajectory for `sample`'s prompt (with `shared_response`, the same length: it belongs to
        the prompt)."""
        if self._shared:
            return sample.turns
        return self._episode(sample.turns[0].input_tokens)

    def _episode(self, prompt: int) -> tuple[Turn, ...]:
        c, rng = self.cfg, self.rng
        if c.kind == "math":
            return (Turn(prompt, draw_int(c.response_tokens, rng), 0.0),)
        turns: list[Turn] = []
        context, inp = 0, prompt
        for _ in range(draw_int(c.turns, rng)):
            room = c.max_context_tokens - context - inp
            if room < 1:
                break
            out = min(draw_int(c.response_tokens, rng), room)
            turns.append(Turn(inp, out, draw(c.tool_latency_s, rng)))
            context += inp + out
            inp = draw_int(c.tool_output_tokens, rng)
            if out == room:
                break
        if not turns:  # the prompt alone fills the context: one minimal turn
            turns.append(Turn(min(prompt, c.max_context_tokens - 1), 1, 0.0))
        last = turns[-1]
        turns[-1] = Turn(last.input_tokens, last.output_tokens, draw(c.test_run_s, rng))
        return tuple(turns)


class SandboxStarts:
    """Container starts of a SWE workload (`workload.sandbox_start_s`): `sandbox_start_slots` of them under way at
    once, the rest in the order asked (a Docker daemon starts containers largely one at a time); each one's
    duration drawn from its own seeded stream, so the episodes' lengths are the same with or without it."""

    def __init__(self, cfg: WorkloadConfig, seed: int) -> None:
        self.dist = cfg.sandbox_start_s
        self.free = [0.0] * cfg.sandbox_start_slots  # when each lane is next free
        self.last_s = 0.0  # the last start's own seconds
        self.rng = random.Random(seed * 1_000_003 + 17)

    def start(self, now: float, stretch: float = 1.0) -> float:
        """A container asked for at `now`, its start taking `stretch` times its drawn duration: when it is ready."""
        lane = min(range(len(self.free)), key=self.free.__getitem__)
        self.last_s = draw(self.dist, self.rng) * stretch  # the start itself, without its wait for a lane
        self.free[lane] = max(now, self.free[lane]) + self.last_s
        return self.free[lane]
