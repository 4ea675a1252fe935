"""Does the trajectory manager's memory stay within its budget however many agents it has served?

    python -m benchmarks.manager_memory [--sessions 600] [--turns 6] [--budgets 0,2000000,500000] [--quick]

Starts a fake engine and, for each budget of tokens held in memory (`serve --max-tokens-in-memory`;
0 here means effectively unbounded), a fresh trajectory manager. Agent sessions then run multi-turn
conversations, each turn adding a tool output of about 300 tokens, so every session's tree and chat
cache keep growing. Prints, per budget: the tokens the manager holds (its own accounting, `/stats`),
the process's resident memory (VmRSS) at the end and at its peak (VmHWM), resident bytes per held
token above the idle baseline, evictions, and what an evicted session costs when it comes back (the
latency of a turn that has to rebuild its session from the store against one that finds it in memory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.harness import engine_token, run_benchmark, start_manager
from core.cli import at_least, list_of
from reference.engine.fake import FakeConfig
from reference.engine.process import EngineProcess, EngineSpec

MODEL = "seamlessflow-tiny"
UNBOUNDED = 10**12
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def tool_output(session: int, turn: int) -> str:
    """About 300 tokens of text that differ between sessions and turns."""
    return " ".join(f"{WORDS[(session * 7 + turn * 3 + i) % len(WORDS)]}{(session + i) % 97}" for i in range(150))


async def turn_s(http, url: str, session: int, messages: list[dict]) -> tuple[float, dict]:
    """One chat turn: (latency in seconds, the assistant's message)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 16}
    start = time.perf_counter()
    async with http.post(f"{url}/s/mem-{session}/v1/chat/completions", json=body) as r:
        reply = await r.json()
        if r.status != 200:
            raise RuntimeError(f"session {session}: {r.status} {reply}")
    return time.perf_counter() - start, reply["choices"][0]["message"]


async def drive(url: str, sessions: int, turns: int, concurrency: int) -> tuple[list[float], dict]:
    latencies: list[float] = []
    histories: dict[int, list[dict]] = {}
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            messages = [{"role": "system", "content": "You are a coding agent."}]
            for turn in range(turns):
                messages.append({"role": "user", "content": tool_output(i, turn)})
                latency, reply = await turn_s(http, url, i, messages)
                latencies.append(latency)
                messages.append(reply)
            histories[i] = messages

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(one(i) for i in range(sessions)))
    return latencies, histories


async def comebacks(url: str, histories: dict, sessions: list[int]) -> float:
    """Median latency of one more turn of finished sessions, one at a time (a session that left memory is
    rebuilt from the store first)."""
    latencies = []
    async with aiohttp.ClientSession() as http:
        for i in sessions:
            messages = [*histories[i], {"role": "user", "content": "and now?"}]
            latencies.append((await turn_s(http, url, i, messages))[0])
    return statistics.median(latencies)


def stats(url: str) -> dict:
    async def get() -> dict:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/stats") as r:
            return await r.json()

    return asyncio.run(get())


def run_budget(engine_url: str, token, budget: int, args, workdir: Path) -> dict:
    extra = [
        "--max-tokens-in-memory",
        str(budget or UNBOUNDED),
        "--max-session-tokens",
        str(budget or UNBOUNDED),
        "--max-in-flight",
        "0",
    ]
    manager = start_manager(engine_url, workdir, token, extra)
    try:
        baseline_kib = vm_kib(manager.pid, "VmRSS")
        latencies, histories = asyncio.run(drive(manager.url, args.sessions, args.turns, args.concurrency))
        s = stats(manager.url)
        rss_kib, peak_kib = vm_kib(manager.pid, "VmRSS"), vm_kib(manager.pid, "VmHWM")
        newest = sorted(histories)[-10:]  # finished last: still in memory under any budget
        back_newest = asyncio.run(comebacks(manager.url, histories, newest))
        back_oldest = asyncio.run(comebacks(manager.url, histories, sorted(histories)[:10]))  # evicted first
    finally:
        manager.close()
    held = s["tokens_in_memory"]
    return {
        "budget_tokens": budget or None,
        "requests": len(latencies),
        "tokens_in_memory": held,
        "sessions_in_memory": s["sessions_in_memory"],
        "evictions": s["evictions"],
        "rss_mb": rss_kib / 1024,
        "peak_rss_mb": peak_kib / 1024,
        "baseline_rss_mb": baseline_kib / 1024,
        "bytes_per_held_token": (rss_kib - baseline_kib) * 1024 / held if held else None,
        "turn_p50_ms": statistics.median(latencies) * 1e3,
        "comeback_oldest_ms": back_oldest * 1e3,
        "comeback_newest_ms": back_newest * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=at_least(1), default=None, help="agent sessions per budget (600; quick: 150)")
    p.add_argument("--turns", type=at_least(1), default=6, help="turns per session")
    p.add_argument("--concurrency", type=at_least(1), default=32)
    p.add_argument(
        "--budgets",
        type=list_of(at_least(0)),
        default=[0, 2000000, 500000],
        help="tokens held in memory, one run each (0: unbounded)",
    )
    p.add_argument("--quick", action="store_true", help="fewer sessions (well under a minute per budget)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    args.sessions = args.sessions or (150 if args.quick else 600)
    budgets = args.budgets
    rows = []
    with (
        EngineProcess(EngineSpec(backend="fake", options=FakeConfig(reply_tokens=16))) as engine,
        tempfile.TemporaryDirectory() as tmp,
    ):
        for budget in budgets:
            rows.append(run_budget(engine.url, engine_token(engine), budget, args, Path(tmp)))
    print(
        f"{args.sessions} sessions x {args.turns} turns, ~300 new tokens a turn, fake engine; memory of the "
        f"manager process"
    )
    print(
        "budget (tokens) | held tokens | sessions held | evictions | RSS MB (peak) | B/held token | "
        "turn p50 ms | comeback oldest / newest ms"
    )
    for r in rows:
        budget = "unbounded" if r["budget_tokens"] is None else f"{r['budget_tokens']:,}"
        per_token = "-" if r["bytes_per_held_token"] is None else f"{r['bytes_per_held_token']:.0f}"
        print(
            f"{budget:>15} | {r['tokens_in_memory']:>11,} | {r['sessions_in_memory']:>13} | {r['evictions']:>9} | "
            f"{r['rss_mb']:6.0f} ({r['peak_rss_mb']:4.0f}) | {per_token:>12} | {r['turn_p50_ms']:11.1f} | "
            f"{r['comeback_oldest_ms']:.1f} / {r['comeback_newest_ms']:.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    run_benchmark(main)
