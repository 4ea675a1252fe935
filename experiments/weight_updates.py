"""Weight updates on the real data plane: partial rollout against draining and against abort-and-restart.

Question: agents keep talking to the trajectory manager while a trainer publishes new weights every
few seconds. What does each way of applying an update cost them and the engine?

- `partial` (SeamlessFlow's partial rollout): pause every engine at a token boundary, load the
  weights, resume; unfinished requests re-prefill and go on, so one response may mix versions.
- `drain` (synchronous pipelines): stop admitting turns, wait until every in-flight request has
  finished, update, admit again; the engine idles while the slowest requests finish.
- `restart`: abandon every in-flight request (the agents disconnect, which aborts them), update,
  send the same turns again from scratch; their tokens so far are wasted.

This runs the real runtime on CPU: the built-in engine (tiny Qwen3) in its own process, the
trajectory manager in a background thread, and agents that stream multi-turn episodes over HTTP
with long-tailed response lengths and a pause for a "tool call" between turns. Numbers are wall-clock
measurements of one run on this machine, not deterministic; the comparison is within one run.

    python -m experiments.weight_updates [--agents 16] [--seconds 30] [--interval-s 3] [--out DIR]
    python -m experiments.weight_updates --replot     # redraw the pictures from the saved data

Writes, in `--out` (default experiments/out/weight_updates): weight_updates.json (per strategy:
useful and generated tokens per second, wasted share, prefill tokens, batch occupancy, turn latency
p50/p99, share of tokens older than the policy when their response finished), weight_updates.png,
and the engine's own activity log under each strategy as the shared timeline record
(weight_updates_intervals.json; its meta also keeps, per strategy, when each request that `restart`
abandoned was generating), drawn as weight_updates_timeline.png (every update a line, the work
`restart` threw away cross-hatched) and exported as weight_updates_trace.json (Chrome trace).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from core.cli import run_main
from core.plot import Overlay, draw_timeline
from core.tags import Phase
from core.timeline import Interval, Timeline
from core.trace import write_chrome_trace
from experiments._common import NO_STAMP, save_json
from reference.engine.process import EngineProcess, EngineSpec
from reference.manager.embedded import ManagerThread
from reference.tokenizer import default_tokenizer

STRATEGIES = ("partial", "drain", "restart")
COLOURS = {"partial": "#1f77b4", "drain": "#7f7f7f", "restart": "#d62728"}
MODEL = "seamlessflow-tiny"
INTERVALS = "weight_updates_intervals.json"  # the engine's activity under every strategy (core.timeline record)


@dataclass
class State:
    """What the controller and the agents share within one strategy's run."""

    strategy: str
    version: int = 0
    epoch: int = 0  # bumped by `restart`: streams started in an older epoch are abandoned
    stop: bool = False
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # cleared by `drain`
    in_flight: int = 0
    bumped_s: float = 0.0  # time.monotonic() of the last epoch bump


@dataclass
class Tally:
    useful_tokens: int = 0
    stale_tokens: int = 0  # tokens sampled by an older version than the policy's when their response finished
    turns: int = 0
    abandoned: int = 0
    latencies_s: list[float] = field(default_factory=list)
    # (first token, abandoned) in time.monotonic() seconds, per request `restart` threw away: the
    # stretch in which the engine generated tokens for nothing
    wasted_spans: list[tuple[float, float]] = field(default_factory=list)


def response_length(rng: random.Random, median: int, cap: int) -> int:
    return max(4, min(cap, int(median * math.exp(rng.gauss(0.0, 0.8)))))


async def one_turn(http, url: str, body: dict, state: State, tally: Tally) -> tuple[dict, str] | None:
    """Stream one completion; (its final chunk, its text), or None if `restart` abandoned it."""
    epoch, text, first_s = state.epoch, [], None
    state.in_flight += 1
    try:
        async with http.post(url, json=body) as response:
            async for raw in response.content:
                if state.epoch != epoch:  # closing the response aborts the engine request
                    tally.abandoned += 1
                    if first_s is not None:
                        tally.wasted_spans.append((first_s, state.bumped_s))
                    return None
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                text.append(choice.get("delta", {}).get("content") or "")
                if first_s is None and text[-1]:  # the engine generates for this request from here on
                    first_s = time.monotonic()
                if choice.get("finish_reason"):
                    return chunk, "".join(text)
    finally:
        state.in_flight -= 1
    raise RuntimeError("stream ended without a final chunk")


async def agent(http, base: str, index: int, state: State, tally: Tally, args) -> None:
    rng = random.Random(index)
    episode, turn, messages = 0, 0, [{"role": "user", "content": f"agent {index}: fix the failing test"}]
    body = None
    while not state.stop:
        await state.gate.wait()
        if body is None:  # a new turn (an abandoned one is sent again unchanged)
            body = {
                "model": MODEL,
                "messages": messages,
                "stream": True,
                "seed": rng.randrange(1 << 30),
                "max_tokens": response_length(rng, args.median_tokens, args.max_tokens),
            }
            start = time.perf_counter()
        done = await one_turn(
            http, f"{base}/s/{state.strategy}-{index}-{episode}/v1/chat/completions", body, state, tally
        )
        if done is None:
            continue  # abandoned by `restart`
        body = None
        final, reply = done
        versions = final["trajectory"]["versions"]
        tally.latencies_s.append(time.perf_counter() - start)
        tally.useful_tokens += len(versions)
        tally.stale_tokens += sum(v < state.version for v in versions)
        tally.turns += 1
        turn += 1
        messages = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": f"output {turn}"}]
        if turn == args.turns:
            episode, turn, messages = episode + 1, 0, messages[:1]
        await asyncio.sleep(args.tool_s)


async def controller(m: ManagerThread, state: State, interval_s: float) -> None:
    async def call(coro):
        return await asyncio.wrap_future(m.submit(coro))

    due = time.perf_counter()
    while not state.stop:
        due += interval_s  # a fixed schedule, however long an update takes
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        if state.stop:
            return
        if state.strategy == "drain":
            state.gate.clear()
            while state.in_flight:
                await asyncio.sleep(0.01)
        elif state.strategy == "restart":
            state.epoch, state.bumped_s = state.epoch + 1, time.monotonic()
        await call(m.manager.pause())
        state.version += 1
        await call(m.manager.update_weights(state.version))
        await call(m.manager.resume())
        state.gate.set()


async def sample_occupancy(engine, state: State, samples: list[int]) -> None:
    while not state.stop:
        samples.append((await engine.stats()).running)
        await asyncio.sleep(0.05)


async def run_strategy(strategy: str, m: ManagerThread, engine, args) -> dict:
    state, tally, occupancy = State(strategy), Tally(), []
    state.gate.set()
    before = (await engine.stats()).extra
    t0 = (await engine.timeline())["now_s"]
    local_t0 = time.monotonic()  # the same instant on this process's clock, to a round trip
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        start = time.perf_counter()
        agents = [asyncio.create_task(agent(http, m.url, i, state, tally, args)) for i in range(args.agents)]
        background = [
            asyncio.create_task(controller(m, state, args.interval_s)),
            asyncio.create_task(sample_occupancy(engine, state, occupancy)),
        ]
        await asyncio.sleep(args.seconds)
        state.stop = True
        state.gate.set()
        await asyncio.gather(*agents, *background)  # every agent finishes its current turn
        wall = time.perf_counter() - start
    after = (await engine.stats()).extra
    activity = engine_intervals(await engine.timeline(), t0, strategy)
    generated = after["tokens_generated"] - before["tokens_generated"]
    lat = sorted(tally.latencies_s)
    return {
        "strategy": strategy,
        "wall_s": wall,
        "updates": state.version,
        "turns": tally.turns,
        "abandoned_requests": tally.abandoned,
        "useful_tokens_per_s": tally.useful_tokens / wall,
        "generated_tokens_per_s": generated / wall,
        "wasted_share": 1 - tally.useful_tokens / generated if generated else 0.0,
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "reprefills": after["reprefills"] - before["reprefills"],
        "batch_occupancy": statistics.fmean(occupancy) / args.max_batch if occupancy else 0.0,
        "idle_share": sum(r == 0 for r in occupancy) / len(occupancy) if occupancy else 0.0,
        "turn_latency_p50_s": lat[len(lat) // 2] if lat else 0.0,
        "turn_latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
        "stale_token_share": tally.stale_tokens / tally.useful_tokens if tally.useful_tokens else 0.0,
        "activity": activity,
        "wasted_spans": [(a - local_t0, b - local_t0) for a, b in sorted(tally.wasted_spans) if b > a],
    }


def engine_intervals(snapshot: dict, t0: float, name: str) -> list[Interval]:
    """The engine's intervals since `t0` (its clock), shifted to start at 0 and named after the strategy."""
    out = []
    for d in snapshot["intervals"]:
        if d["start_s"] >= t0:
            fields = {**d, "resource": name, "tags": tuple(d["tags"]), "phase": Phase(d["phase"])}
            out.append(Interval(**{**fields, "start_s": d["start_s"] - t0, "end_s": d["end_s"] - t0}))
    return out


def activity_timeline(results: list[dict], max_batch: int) -> Timeline:
    """One row per strategy; shorter runs padded with idle to the longest. meta keeps each strategy's
    wasted spans (seconds since its run started) and the engine's batch size, to draw the waste."""
    wall = max(r["activity"][-1].end_s for r in results if r["activity"])
    intervals = []
    for r in results:
        intervals += r["activity"]
        last = r["activity"][-1]
        if last.end_s < wall:
            intervals.append(Interval(last.resource, last.tags, last.active, Phase.IDLE, last.end_s, wall, 0, 0, 1))
    wasted = {r["strategy"]: [list(span) for span in r["wasted_spans"]] for r in results}
    return Timeline(intervals, [], wall, {"clock": "measured", "max_batch": max_batch, "wasted_spans": wasted})


def overlapping(spans: list[list[float]]) -> list[tuple[float, float, int]]:
    """(start, end, count): the stretches over which `count` > 0 of `spans` overlap."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    out, count, last = [], 0, 0.0
    for t, change in events:
        if count > 0 and t > last:
            out.append((last, t, count))
        count, last = count + change, t
    return out


def wasted_overlay(timeline: Timeline) -> Overlay:
    """How much of the engine's batch was generating tokens that `restart` later threw away."""
    batch = timeline.meta["max_batch"]
    spans = [
        (strategy, start, end, min(1.0, count / batch))
        for strategy, wasted in timeline.meta["wasted_spans"].items()
        for start, end, count in overlapping(wasted)
    ]
    return Overlay("generated, then thrown away\n(height: share of the batch)", tuple(spans))


def draw_activity(timeline: Timeline, results: list[dict], run_args: dict, path: Path) -> None:
    updates = ", ".join(f"{r['strategy']} {r['updates']}" for r in results)
    overlay = wasted_overlay(timeline)
    draw_timeline(
        timeline,
        path,
        f"The engine's activity under each strategy (weight updates: {updates})",
        ylabel="strategy",
        phase_labels={Phase.SYNC: "paused for a weight update", Phase.ROLLOUT: "generating (shade: see bar)"},
        overlays=[overlay] if overlay.spans else [],
        caption=f"Each row is the built-in engine (batch of {run_args['max_batch']}) during one strategy's run of "
        f"{run_args['seconds']:g} s; runs are aligned at their start. Pauses are drawn at least 2 px wide.",
    )


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("useful_tokens_per_s", "useful tokens / s", 1),
        ("batch_occupancy", "engine batch occupancy (%)", 100),
        ("wasted_share", "generated tokens wasted (%)", 100),
        ("turn_latency_p99_s", "turn latency p99 (s)", 1),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.2))
    names = [r["strategy"] for r in results]
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        values = [r[key] * scale for r in results]
        ax.bar(names, values, color=[COLOURS[n] for n in names])
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, max(values + [1e-9]) * 1.18)
        for x, v in enumerate(values):
            ax.annotate(f"{v:.1f}" if v < 100 else f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle("Applying a weight update every few seconds while agents stream (built-in engine, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata=NO_STAMP)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.weight_updates", description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=16, help="concurrent agents (twice the engine batch by default)")
    p.add_argument("--seconds", type=float, default=30.0, help="measured time per strategy")
    p.add_argument("--interval-s", type=float, default=3.0, help="seconds between weight updates")
    p.add_argument("--turns", type=int, default=4, help="turns per episode")
    p.add_argument("--tool-s", type=float, default=0.2, help="agent-side pause between turns")
    p.add_argument("--median-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--out", default="experiments/out/weight_updates")
    p.add_argument(
        "--replot", action="store_true", help=f"redraw the pictures from weight_updates.json and {INTERVALS} in --out"
    )
    args = p.parse_args(argv)
    bad = [s for s in args.strategies.split(",") if s not in STRATEGIES]
    if bad:
        p.error(f"unknown strategy {bad[0]!r}; valid choices: {', '.join(STRATEGIES)}")
    return args


async def run_all(args, m: ManagerThread, engine) -> list[dict]:
    results = []
    for strategy in args.strategies.split(","):
        print(f"{strategy}: {args.seconds:.0f} s with {args.agents} agents ...", flush=True)
        results.append(await run_strategy(strategy, m, engine, args))
    await engine.close()
    return results


def measure(args, out: Path) -> tuple[dict, Timeline]:
    """Run every strategy; save weight_updates.json and the engine's activity (INTERVALS)."""
    with tempfile.TemporaryDirectory() as tmp, EngineProcess(EngineSpec(max_batch=args.max_batch)) as proc:
        with ManagerThread({"e0": proc.client()}, default_tokenizer(), Path(tmp) / "t.sqlite") as m:
            results = asyncio.run(run_all(args, m, proc.client()))
    timeline = activity_timeline(results, args.max_batch)
    timeline.save(out / INTERVALS)
    for r in results:
        del r["activity"], r["wasted_spans"]
    data = {"args": {k: v for k, v in vars(args).items() if k != "replot"}, "results": results}
    save_json(data, out / "weight_updates.json")
    return data, timeline


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: weight_updates(args))


def weight_updates(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        data, timeline = json.loads((out / "weight_updates.json").read_text()), Timeline.load(out / INTERVALS)
    else:
        data, timeline = measure(args, out)
    results = data["results"]
    write_chrome_trace(timeline, out / "weight_updates_trace.json")
    draw_activity(timeline, results, data["args"], out / "weight_updates_timeline.png")
    plot(results, out / "weight_updates.png")
    keys = (
        "useful_tokens_per_s",
        "batch_occupancy",
        "idle_share",
        "wasted_share",
        "turn_latency_p50_s",
        "turn_latency_p99_s",
        "stale_token_share",
        "updates",
    )
    print(f"{'strategy':>9} " + " ".join(f"{k:>20}" for k in keys))
    for r in results:
        print(f"{r['strategy']:>9} " + " ".join(f"{r[k]:20.3f}" for k in keys))
    print(f"outputs: {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
