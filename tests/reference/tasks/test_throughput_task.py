"""The throughput workload: lengths drawn as the simulator draws them, deterministic per problem, graded by length,
and forced end to end through the rollout manager and the trajectory manager."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest

from core import config as cfgio
from reference.engine.fake import FakeEngine
from reference.manager.embedded import ManagerThread
from reference.rollout.groups import RolloutConfig, RolloutManager
from reference.tasks import make_task
from reference.tasks.throughput import ThroughputConfig, ThroughputTask
from sim.config import DEFAULT_CONFIG, Dist, SimConfig
from sim.workload import draw_int


@pytest.fixture(scope="module")
def task() -> ThroughputTask:
    return make_task("throughput")


@pytest.fixture(scope="module")
def many(task) -> list:
    return task.sample_train(random.Random(0), 10_000)


def capped_lognormal_mean(median: float, sigma: float, cap: float) -> float:
    """E[min(median * exp(sigma * Z), cap)], Z standard normal (the floor at 1 token is negligible here)."""
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    z = math.log(cap / median) / sigma
    return median * math.exp(sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))


def test_every_problem_forces_a_length_within_the_configured_bounds(many):
    assert all(p.ignore_eos for p in many)
    assert all(1 <= p.max_tokens <= 256 for p in many)
    assert all(p.answer == str(p.max_tokens) for p in many)


def test_prompts_are_digit_strings_of_their_drawn_length(task, many):
    lengths = [len(task.tokenizer.encode(p.prompt)) for p in many]
    assert all(p.prompt.isdigit() for p in many)
    assert lengths == [len(p.prompt) for p in many]  # one token a character
    assert 1 <= min(lengths) and max(lengths) <= 32
    assert statistics.median(lengths) == 6


def test_lengths_are_a_pure_function_of_the_problem_and_the_seed(task):
    a = task.sample_train(random.Random(7), 50)
    assert a == ThroughputTask().sample_train(random.Random(7), 50)
    assert a != task.sample_train(random.Random(8), 50)
    assert ThroughputTask().problem(12345) == task.problem(12345)
    assert ThroughputTask(salt="other").problem(12345) != task.problem(12345)
    assert ThroughputTask().held_out() == task.held_out()
    assert len(task.held_out()) == 8


def test_lengths_are_drawn_exactly_as_the_simulator_draws_them(task):
    prompt, response = (Dist(**task.config.dist(part)) for part in ("prompt", "response"))
    for key in range(200):
        rng = random.Random(f"{task.config.salt}:{key}")
        p = task.problem(key)
        assert (len(p.prompt), p.max_tokens) == (draw_int(prompt, rng), draw_int(response, rng))


def test_the_distribution_has_the_configured_median_mean_and_cap(many):
    lengths = [p.max_tokens for p in many]
    assert statistics.median(lengths) == pytest.approx(39, rel=0.05)
    assert statistics.fmean(lengths) == pytest.approx(capped_lognormal_mean(39, 0.8, 256), rel=0.03)  # about 52.9
    at_cap = sum(n == 256 for n in lengths) / len(lengths)
    assert at_cap == pytest.approx(1 - 0.5 * (1 + math.erf(math.log(256 / 39) / 0.8 / math.sqrt(2))), rel=0.25)


def test_options_reshape_the_distribution():
    task = ThroughputTask(response_median_tokens=10, response_sigma=0.0, response_max_tokens=64)
    assert {p.max_tokens for p in task.sample_train(random.Random(1), 100)} == {10}
    assert task.max_tokens == 64


def test_reward_is_one_for_the_forced_length_only(task):
    p = task.problem(1)
    n = p.max_tokens
    assert task.grade(p, "7" * n).reward == 1.0
    assert task.grade(p, "7" * n).exact
    assert task.grade(p, "7" * (n - 1)).reward == 0.0
    assert task.grade(p, "7" * (n + 1)).reward == 0.0
    assert task.grade(p, "<|im_end|>" + "7" * (n - 1)).reward == 1.0  # a sampled stop token is one token
    assert task.grade(p, "letters").reward == 0.0  # not this tokenizer's text: not the length


def test_any_sampled_ids_decode_to_text_of_as_many_tokens(task):
    rng, tok = random.Random(3), task.tokenizer
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        assert len(tok.encode(tok.decode(ids))) == len(ids)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"response_median_tokens": 300}, "response_min_tokens <= response_median_tokens <= response_max_tokens"),
        ({"response_sigma": -0.1}, "sigma >= 0"),
        ({"response_min_tokens": 0}, "response_min_tokens must be an integer in [1, 65536]"),
        ({"prompt_max_tokens": 2.5}, "prompt_max_tokens must be an integer"),
        ({"prompt_median_tokens": "six"}, "prompt_median_tokens must be a finite number"),
        ({"prompt_max_tokens": 300, "response_max_tokens": 256}, "prompt_max_tokens (300) must be <="),
        ({"held_out_size": 0}, "held_out_size must be an integer in [1, 1024]"),
    ],
)
def test_bad_options_name_the_field(overrides, needle):
    with pytest.raises(ValueError) as e:
        ThroughputConfig(**overrides)
    assert needle in str(e.value)


def test_the_workload_is_expressible_in_the_simulator(task):
    data = cfgio.merge(cfgio.load_yaml(DEFAULT_CONFIG), {"workload": task.simulator_workload()})
    sim = cfgio.from_dict(SimConfig, data)
    assert sim.workload.kind == "math"
    assert sim.workload.response_tokens == Dist(median=39.0, sigma=0.8, min=1, max=256)
    assert sim.workload.prompt_tokens == Dist(median=6.0, sigma=0.4, min=1, max=32)
    assert sim.workload.shared_response  # one forced length per problem, as the rollout manager sends a group


def test_lengths_are_forced_end_to_end_through_the_rollout_manager(task, tmp_path):
    """A fake engine that would end every sample with a stop token after 2 tokens, and samples the stop tokens
    on its own (22-token vocabulary): each sample still has its problem's length, and reward 1."""
    engine = FakeEngine(vocab_size=task.tokenizer.vocab_size, reply_tokens=2)
    with ManagerThread({"fake-0": engine}, task.tokenizer, tmp_path / "t.sqlite") as m:
        groups = asyncio.run(asyncio.wait_for(_rollout(task, m.url, num_groups=3), timeout=60))
    assert len(groups) == 3
    for g in groups:
        assert [s.tokens for s in g.episodes] == [g.problem.max_tokens] * 4
        assert g.mean_reward == 1.0


async def _rollout(task, url: str, num_groups: int) -> list:
    done = []
    async with RolloutManager(task, url, RolloutConfig(group_size=4), "tp", 0, done.append) as rollout:
        rollout.submit(num_groups)
        while len(done) < num_groups and rollout.failure is None:
            await asyncio.sleep(0.01)
    assert rollout.failure is None
    return done
