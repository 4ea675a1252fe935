"""The engine's activity log: timeline intervals in the shared record, covering its life without gaps."""

from __future__ import annotations

import asyncio

from core.tags import Phase
from reference.engine.activity import ActivityLog
from reference.engine.base import GenerateRequest, SamplingParams, generate
from reference.engine.builtin import BuiltinEngine
from reference.model import build_model, tiny_config

SMALL = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "head_dim": 16}


def test_activity_log_splits_on_batch_and_version():
    now = [0.0]
    log = ActivityLog(clock=lambda: now[0])
    for t, phase, batch, version, tokens in [(1, Phase.ROLLOUT, 2, 0, 4), (2, Phase.ROLLOUT, 2, 0, 2),
                                             (3, Phase.ROLLOUT, 1, 0, 1), (4, Phase.SYNC, 0, 0, 0),
                                             (5, Phase.ROLLOUT, 1, 1, 1)]:  # fmt: skip
        now[0] = t
        log.mark(phase, batch, version)
        log.add_tokens(tokens)
    now[0] = 6
    snap = log.snapshot()
    got = [(iv["phase"], iv["start_s"], iv["end_s"], iv["step"], iv["tokens"]) for iv in snap["intervals"]]
    assert got == [
        ("idle", 0, 1, 0, 0),
        ("rollout", 1, 3, 0, 6),  # same batch and version: one interval
        ("rollout", 3, 4, 0, 1),
        ("sync", 4, 5, 0, 0),
        ("rollout", 5, 6, 1, 1),
    ]
    assert snap["now_s"] == 6


def test_engine_timeline_covers_its_life_and_counts_every_token():
    model = build_model(tiny_config(256, **SMALL), seed=0)

    async def main(engine: BuiltinEngine):
        requests = [GenerateRequest(f"r{i}", (1, 2, 3 + i), SamplingParams(max_tokens=8 + 4 * i)) for i in range(3)]
        results = await asyncio.gather(*(generate(engine, r) for r in requests))
        await engine.pause()
        await engine.update_weights(1)
        await engine.resume()
        results.append(await generate(engine, GenerateRequest("late", (5, 6), SamplingParams(max_tokens=5))))
        return results, await engine.timeline()

    with BuiltinEngine(model, max_batch=2) as engine:
        results, snap = asyncio.run(main(engine))
    intervals = snap["intervals"]
    assert intervals[0]["start_s"] == 0.0 and intervals[-1]["end_s"] == snap["now_s"]
    assert all(a["end_s"] == b["start_s"] for a, b in zip(intervals, intervals[1:], strict=False))
    assert sum(iv["tokens"] for iv in intervals) == sum(len(r.token_ids) for r in results)
    phases = [iv["phase"] for iv in intervals]
    assert "sync" in phases and phases.index("sync") < len(phases) - 1
    assert {iv["step"] for iv in intervals if iv["phase"] == "rollout"} == {0, 1}
    assert max(iv["tokens"] for iv in intervals if iv["phase"] == "rollout") > 0
