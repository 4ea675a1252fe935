"""Tests for sim.workload: length bounds, SWE context limits, determinism, sample bookkeeping."""

from __future__ import annotations

import random

import pytest

from core.errors import UserError
from sim.config import Dist, load_config
from sim.workload import Sample, Turn, Workload, draw, draw_int


def workload(seed: int = 0, *overrides: str) -> Workload:
    return Workload(load_config(overrides=list(overrides)).workload, seed)


def groups(w: Workload, n: int) -> list[list[Sample]]:
    return [w.new_group() for _ in range(n)]


def within(value: float, dist: Dist) -> bool:
    return dist.min <= value <= dist.max


def test_draw_is_clipped_and_constant_without_spread():
    rng = random.Random(1)
    d = Dist(median=100, sigma=2.0, min=50, max=150)
    values = [draw(d, rng) for _ in range(2000)]
    assert min(values) == 50 and max(values) == 150  # wide sigma: both clips are hit
    assert all(50 <= v <= 150 for v in values)
    assert {draw(Dist(300, 0.0, 1, 1000), rng) for _ in range(10)} == {300}
    assert draw_int(Dist(0.2, 0.0, 0.0, 1.0), rng) == 1  # at least one token


def test_math_samples_are_one_turn_within_bounds_and_share_their_prompt():
    w = workload(3)
    c = w.cfg
    for group in groups(w, 50):
        assert len(group) == c.group_size
        assert len({s.turns[0].input_tokens for s in group}) == 1  # GRPO: one prompt per group
        for s in group:
            (turn,) = s.turns
            assert within(turn.input_tokens, c.prompt_tokens) and within(turn.output_tokens, c.response_tokens)
            assert turn.wait_s == 0.0
    assert [g[0].group_id for g in groups(w, 3)] == [50, 51, 52]


@pytest.mark.parametrize("max_context", [32768, 4096, 600, 40])
def test_swe_episodes_never_exceed_the_context_limit(max_context):
    w = workload(5, "workload.kind=swe", f"workload.max_context_tokens={max_context}")
    c = w.cfg
    assert w.max_request_tokens == max_context
    samples = [s for g in groups(w, 40) for s in g]
    truncated = 0
    for s in samples:
        assert 1 <= len(s.turns) <= c.turns.max
        context = 0
        for i, turn in enumerate(s.turns):
            context += turn.input_tokens + turn.output_tokens
            assert context <= max_context  # every request fits, so the KV check at start-up is sound
            assert turn.output_tokens >= 1 and turn.output_tokens <= c.response_tokens.max
            last = i == len(s.turns) - 1
            assert within(turn.wait_s, c.test_run_s if last else c.tool_latency_s)
            if i:
                assert within(turn.input_tokens, c.tool_output_tokens)
        assert s.total_tokens == context
        truncated += len(s.turns) < c.turns.min or context == max_context
    if max_context <= 600:
        assert truncated  # the limit really bites at this size


def test_a_prompt_longer_than_the_context_still_makes_a_valid_episode():
    w = workload(
        0,
        "workload.kind=swe",
        "workload.max_context_tokens=100",
        "workload.prompt_tokens.min=200",
        "workload.prompt_tokens.median=300",
    )
    (sample, *_) = w.new_group()
    assert sample.turns[0].input_tokens == 99 and sample.turns[0].output_tokens == 1
    assert sample.total_tokens == 100


def test_swe_turn_count_and_lengths_follow_their_distributions():
    w = workload(11, "workload.kind=swe")
    c = w.cfg
    samples = [s for g in groups(w, 30) for s in g]
    prompts = {s.group_id: s.turns[0].input_tokens for s in samples}
    assert all(within(p, c.prompt_tokens) for p in prompts.values())
    assert all(s.turns[0].input_tokens == prompts[s.group_id] for s in samples)
    counts = sorted(len(s.turns) for s in samples)
    assert counts[len(counts) // 2] == pytest.approx(c.turns.median, rel=0.35)  # median near the configured one
    assert len(set(counts)) > 5  # spread, not a constant


@pytest.mark.parametrize("kind", ["math", "swe"])
def test_workloads_are_deterministic_for_a_seed(kind):
    def turns(seed):
        w = workload(seed, f"workload.kind={kind}")
        made = groups(w, 8)
        return [s.turns for g in made for s in g] + [w.redraw(made[0][0])]

    assert turns(4) == turns(4)
    assert turns(4) != turns(5)


def test_shared_response_gives_a_group_one_length_and_keeps_it_on_restart():
    per_sample, shared = workload(4), workload(4, "workload.shared_response=true")
    spread = [len({s.turns[0].output_tokens for s in g}) for g in groups(per_sample, 20)]
    assert max(spread) > 1  # by default each sample draws its own length
    lengths = []
    for group in groups(shared, 20):
        assert len({s.turns for s in group}) == 1
        assert shared.redraw(group[0]) == group[0].turns  # the length belongs to the prompt
        lengths.append(group[0].turns[0].output_tokens)
    assert len(set(lengths)) > 1  # the spread is between groups


def test_redraw_keeps_the_prompt():
    w = workload(2, "workload.kind=swe")
    sample = w.new_group()[0]
    fresh = w.redraw(sample)
    assert fresh[0].input_tokens == sample.turns[0].input_tokens and fresh != sample.turns


def test_sample_bookkeeping_through_turns_versions_and_restart():
    turns = (Turn(100, 10, 1.0), Turn(20, 5, 2.0))
    s = Sample(group_id=0, index=0, turns=turns)
    assert s.min_version == 0 and s.prefix_tokens == 100 and s.final_context == 110 and s.remaining == 10
    s.add_tokens(version=3, count=4)
    s.add_tokens(version=4, count=6)
    s.add_tokens(version=9, count=0)  # nothing generated: no version recorded
    assert s.version_tokens == {3: 4, 4: 6} and s.min_version == 3 and s.remaining == 0
    assert s.prefix_tokens == 110
    assert s.finish_turn() is False
    assert (s.context, s.generated, s.prefix_tokens, s.final_context) == (110, 0, 130, 135)
    s.add_tokens(5, 5)
    assert s.finish_turn() is True
    assert s.total_tokens == 135 and s.generated_tokens == 15
    fresh = (Turn(100, 7, 0.0),)
    assert s.restart(fresh) == 15  # every generated token is lost
    assert (s.turns, s.turn, s.context, s.version_tokens, s.restarts, s.engine) == (fresh, 0, 0, {}, 1, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["workload.response_tokens.max=65536"],
            r"workload.prompt_tokens.max \+ workload.response_tokens.max \(2048 \+ 65536\) is 67,584 tokens, more "
            r"than the 40,960-token context of the model 'qwen3-32b'",
        ),
        (
            ["workload.kind=swe", "workload.max_context_tokens=65536"],
            "workload.max_context_tokens is 65,536 tokens, more than the 40,960-token context",
        ),
    ],
)
def test_a_request_longer_than_the_models_context_is_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(overrides=overrides)


def test_a_request_that_just_fits_the_models_context_is_allowed():
    load_config(overrides=["workload.prompt_tokens.max=4096", "workload.response_tokens.max=36864"])
