"""The paged KV cache of sim/engine.py: block counts against a naive count, capacity never exceeded,
preemption by recompute, chunked prefill, prefix caching of a group's prompt, agreement with the
reservation model where the two coincide, and the config errors of the new options."""

from __future__ import annotations

import random

import pytest

from core.errors import UserError
from core.metrics import summarize
from core.policies import POLICIES
from core.tags import Phase
from sim.config import load_config
from sim.engine import SimEngine
from sim.kv_blocks import NEVER, BlockLedger
from sim.report import write_run
from sim.runner import Simulation, simulate

# The small config of conftest.py with 60 GB of each GPU kept as workspace: about 45k KV tokens an
# engine, against 16 requests of ~4k tokens each, so engines run out of blocks and preempt.
TIGHT = ("rollout.kv_allocation=paged", "rollout.workspace_gb=60")
# One engine of 8 GPUs running a small model, one prompt a step, identical lengths: runs whose
# timings and counts can be written down by hand.
ONE_ENGINE = (
    "rollout.kv_allocation=paged",
    "num_steps=1",
    "cluster.num_gpus=8",
    "rollout.tensor_parallel=8",
    "model=qwen3-0.6b",
    "workload.prompts_per_step=1",
    "workload.prompt_tokens.sigma=0",
    "workload.response_tokens.sigma=0",
    "workload.response_tokens.median=100",
    "workload.response_tokens.max=100",
)


def fixed_prompt(tokens: int) -> tuple[str, ...]:
    return (f"workload.prompt_tokens.median={tokens}", f"workload.prompt_tokens.max={tokens}")


def naive_blocks(engine: SimEngine, step: int) -> int:
    """Blocks the step that starts at `step` needs, request by request: each decoding request its
    context plus the token the step appends, each prefilling request what it took at admission, and
    each group's shared prompt blocks once."""
    bs = engine.block_tokens
    total, groups = 0, {}
    for sample, seq in engine.batch.items():
        total += -(-(seq.offset + step + 1) // bs) - seq.shared
        groups[sample.group_id] = seq.shared
    for sample, seq in engine.prefilling.items():
        total += seq.blocks
        groups[sample.group_id] = seq.shared
    return total + sum(groups.values())


# ---- the block ledger ----


def naive_ledger(base: int, requests: list[tuple[int, int]], bs: int, step: int) -> int:
    """Blocks at `step` of decoding requests (offset, shared blocks) over `base` fixed ones."""
    return base + sum(-(-(offset + step + 1) // bs) - shared for offset, shared in requests)


def test_block_ledger_counts_and_finds_the_first_short_step_like_a_naive_scan():
    rng = random.Random(0)
    for _ in range(200):
        bs = rng.choice([1, 2, 16, 64])
        requests = [(rng.randint(-5000, 5000), rng.randint(0, 3)) for _ in range(rng.randint(0, 12))]
        base = rng.randint(0, 50)  # blocks of prefilling requests and shared prompts
        start = rng.randint(5000, 7000)  # contexts offset + step stay positive
        ledger = BlockLedger(capacity=naive_ledger(base, requests, bs, start) + rng.randint(-3, 40), block_tokens=bs)
        ledger.base = base
        for offset, shared in requests:
            ledger.add_decoding(offset, shared)
        for step in (start, start + 1, start + bs, start + 999):
            assert ledger.needed(step) == naive_ledger(base, requests, bs, step)
        horizon = start + (ledger.capacity + 2) * bs  # by then any decoding request has outgrown it
        short = (s for s in range(start, horizon) if naive_ledger(base, requests, bs, s) > ledger.capacity)
        first = next(short, NEVER)
        assert ledger.first_overflow(start) == first
        for offset, shared in requests:
            ledger.add_decoding(offset, shared, sign=-1)
        assert ledger.decoding == 0 and not any(ledger.hist) and ledger.base == base


# ---- memory pressure ----


def test_paged_engines_never_need_more_blocks_than_the_cache_holds(small_config, monkeypatch):
    """Every planned stretch of steps is checked against a naive count at its first and last step
    (blocks only grow within a stretch), and the engines preempt to stay inside the cache."""
    plan = SimEngine._steps_to_next_event
    checked = []

    def checked_plan(engine: SimEngine) -> int:
        steps = plan(engine)
        last = engine.steps + max(steps, 1) - 1
        for step in (engine.steps, last):
            assert engine.kv_blocks.needed(step) == naive_blocks(engine, step)
        assert naive_blocks(engine, last) <= engine.kv_blocks.capacity
        checked.append(naive_blocks(engine, last))
        return steps

    monkeypatch.setattr(SimEngine, "_steps_to_next_event", checked_plan)
    sim = Simulation.from_config(small_config(*TIGHT, "rollout.prefix_caching=true"), "tag")
    timeline = sim.run()
    assert timeline.counters["kv_preemptions"] > 0 and timeline.counters["recomputed_tokens"] > 0
    assert max(checked) == max(e.kv_peak_blocks for e in sim.engines.values())
    assert all(e.kv_peak_blocks <= e.kv_blocks.capacity for e in sim.engines.values())
    assert any(e.kv_peak_blocks == e.kv_blocks.capacity for e in sim.engines.values())  # they do fill up


def test_preempted_requests_finish_with_exactly_their_tokens(small_config, monkeypatch):
    """Colocated trains every token it generates: with preemptions (tokens kept, the KV recomputed),
    each sample still trains exactly its drawn response lengths, and the engines counted each
    generated token once."""
    trained = []
    start_train = Simulation.start_train

    def record(sim: Simulation, d) -> None:
        trained.extend(s for gid in d.group_ids for s in sim.groups[gid])
        start_train(sim, d)

    monkeypatch.setattr(Simulation, "start_train", record)
    for kind in ("math", "swe"):
        trained.clear()
        cfg = small_config(*TIGHT, f"workload.kind={kind}")  # swe: swe.yaml's group size (8)
        timeline = Simulation.from_config(cfg, "colocated").run()
        assert timeline.counters["kv_preemptions"] > 0
        assert len(trained) == 4 * 16 * cfg.workload.group_size
        for sample in trained:
            assert sum(sample.version_tokens.values()) == sample.generated_tokens
        generated = sum(iv.tokens for iv in timeline.intervals if iv.phase is Phase.ROLLOUT)
        assert generated == sum(s.generated_tokens for s in trained)
        assert timeline.counters["recomputed_tokens"] < timeline.counters["prefill_tokens"]


def test_paged_runs_are_byte_for_byte_repeatable(small_config, tmp_path):
    cfg = small_config(*TIGHT, "rollout.prefix_caching=true", "rollout.max_num_batched_tokens=2048", "num_steps=3")
    for folder in ("a", "b"):
        write_run(simulate(cfg, "tag"), cfg, tmp_path / folder, picture=False)
    for name in ("summary.json", "intervals.json", "timeline.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# ---- where the two models coincide ----


@pytest.mark.parametrize("kind", ["math", "swe"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_with_ample_memory_paged_and_reserve_give_the_same_timeline(small_config, policy, kind):
    """Neither model ever runs short of cache here (B200 engines hold 2.2M tokens; 256 requests of at
    most 6144 tokens need 1.6M), max_num_seqs never binds, the token budget holds any step's prefill
    whole and groups share nothing: then paged admission, chunked prefill and reservation are the same
    mechanism, and every interval, step record and counter is exactly equal."""
    common = (
        "cluster.device=b200",
        "workload.response_tokens.max=4096",
        "workload.max_context_tokens=6144",
        "rollout.max_num_seqs=4096",
        "rollout.max_num_batched_tokens=1000000000",
        f"workload.kind={kind}",
    )
    paged = simulate(small_config(*common, "rollout.kv_allocation=paged", "rollout.prefix_caching=false"), policy)
    reserve = simulate(small_config(*common, "rollout.kv_allocation=reserve"), policy)
    assert paged == reserve
    assert "kv_preemptions" not in paged.counters


# ---- chunked prefill and prefix caching ----


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget(small_config):
    """One request of a 5000-token prompt under a 1024-token budget: four full chunks and one of 904
    tokens, each at the cost of its own prefill pass, then 100 decode steps."""
    sim = Simulation.from_config(small_config(*ONE_ENGINE, *fixed_prompt(5000), "workload.group_size=1",
                                  "rollout.max_num_batched_tokens=1024"), "colocated")  # fmt: skip
    timeline = sim.run()
    seconds, done = 0.0, 0
    for chunk in (1024, 1024, 1024, 1024, 904):
        seconds += sim.cost.prefill_s(chunk, chunk * (done + chunk / 2))
        done += chunk
    rollout = next(iv for iv in timeline.intervals if iv.phase is Phase.ROLLOUT)
    assert rollout.end_s == pytest.approx(seconds + sim.cost.decode_run_s(1, 5000, 100), rel=1e-12)
    assert timeline.counters["prefill_tokens"] == 5000


def test_prefix_caching_prefills_a_groups_prompt_once(small_config):
    """Eight samples of one 400-token prompt on one engine: the first prefills it all, the others
    only what follows its full blocks (24 blocks of 16 = 384 tokens), and those 24 blocks are held once."""
    runs = {}
    for caching in (True, False):
        cfg = small_config(
            *ONE_ENGINE, *fixed_prompt(400), "workload.group_size=8", f"rollout.prefix_caching={caching}"
        )
        sim = Simulation.from_config(cfg, "colocated")
        runs[caching] = (sim.run(), sim.engines["C00"])
    (shared, shared_engine), (alone, alone_engine) = runs[True], runs[False]
    assert shared.counters["prefill_tokens"] == 400 + 7 * (400 - 384)
    assert alone.counters["prefill_tokens"] == 8 * 400
    assert alone_engine.kv_peak_blocks == 8 * -(-500 // 16)  # prompt + 100 tokens each, at the last step
    assert shared_engine.kv_peak_blocks == alone_engine.kv_peak_blocks - 7 * 24
    assert summarize(shared)["wall_s"] < summarize(alone)["wall_s"]


# ---- config ----


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.kv_allocation=paging", r"unknown rollout.kv_allocation 'paging'; valid choices: paged, reserve"),
        ("rollout.kv_block_tokens=0", r"rollout.kv_block_tokens must be >= 1, got 0"),
        (
            "rollout.max_num_batched_tokens=100",
            r"rollout.max_num_batched_tokens=100 must be >= rollout.max_num_seqs=256",
        ),
        ("rollout.prefix_caching=maybe", r"config key 'rollout.prefix_caching' must be true or false"),
        ("rollout.kv_block_tokens=1.5", r"config key 'rollout.kv_block_tokens' must be an integer"),
    ],
)
def test_bad_rollout_options_name_the_key(override, message):
    with pytest.raises(UserError, match=message):
        load_config(overrides=[override])
