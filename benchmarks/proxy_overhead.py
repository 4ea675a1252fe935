"""What does the trajectory manager add to an engine call? (proxy overhead benchmark)

    python -m benchmarks.proxy_overhead [--levels 1,64,256] [--turns 4] [--reply-tokens 16]

Starts a fast fake engine in its own process and the trajectory manager (`python -m reference
serve --engine-url ...`) in another. At each concurrency level, that many sessions each run a
multi-turn conversation, once straight against the engine (the same token ids, rendered here)
and once through the manager's OpenAI endpoint. Prints p50 / p99 latency of both, the added
latency, and requests per second. The load generator shares the machine's cores with both
servers, so absolute numbers are pessimistic; the comparison is within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from reference.engine.process import EngineProcess, EngineSpec
from reference.manager.chat import ChatRenderer
from reference.tokenizer import default_tokenizer

MODEL = "seamlessflow-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_manager(engine_url: str, store: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "reference", "serve", "--engine-url", engine_url, "--port", str(port),
         "--store", str(store)],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the manager did not start")


def conversation(session: int, turn: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for k in range(turn):
        messages += [
            {"role": "user", "content": f"session {session} step {k}: run the tests and report"},
            {"role": "assistant", "content": f"ran step {k}"},
        ]
    return [*messages, {"role": "user", "content": f"session {session} step {turn}: what next?"}]


async def direct_session(http, engine_url, tok, session: int, turns: int, reply: int, lat: list[float]) -> None:
    renderer = ChatRenderer(tok)
    for turn in range(turns):
        body = {"request_id": f"d{session}.{turn}.{time.monotonic_ns()}",
                "prompt_token_ids": renderer.render(conversation(session, turn)),
                "params": {"max_tokens": reply, "stop_token_ids": [tok.im_end_id, tok.eos_token_id]}}  # fmt: skip
        start = time.perf_counter()
        async with http.post(f"{engine_url}/generate", json=body) as r:
            async for line in r.content:
                if b"finish" in line:
                    break
        lat.append(time.perf_counter() - start)


async def proxy_session(http, manager_url, session: int, turns: int, reply: int, lat: list[float]) -> None:
    for turn in range(turns):
        body = {"model": MODEL, "messages": conversation(session, turn), "max_tokens": reply}
        start = time.perf_counter()
        async with http.post(f"{manager_url}/s/bench-{session}/v1/chat/completions", json=body) as r:
            payload = await r.read()
            if r.status != 200:
                raise RuntimeError(f"manager answered {r.status}: {payload[:200]!r}")
            json.loads(payload)
        lat.append(time.perf_counter() - start)


async def run_level(
    mode: str, url: str, tok, concurrency: int, turns: int, reply: int, min_requests: int
) -> tuple[list[float], float]:
    """`concurrency` workers, each running sessions of `turns` turns one after another, until at
    least `min_requests` requests were made. Returns the latencies and requests per second."""
    lat: list[float] = []
    sessions_per_worker = max(1, -(-min_requests // (concurrency * turns)))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)

    async def worker(w: int) -> None:
        for k in range(sessions_per_worker):
            session = (w * sessions_per_worker + k) + concurrency * 100_000  # unique per level
            if mode == "direct":
                await direct_session(http, url, tok, session, turns, reply, lat)
            else:
                await proxy_session(http, url, session, turns, reply, lat)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - start
    return lat, len(lat) / wall


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,64,256", help="concurrent sessions per level (comma-separated)")
    ap.add_argument("--turns", type=int, default=4, help="requests per session")
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--min-requests", type=int, default=400, help="requests per level and path, at least")
    args = ap.parse_args()
    tok = default_tokenizer()
    levels = [int(x) for x in args.levels.split(",")]
    with (
        tempfile.TemporaryDirectory() as tmp,
        EngineProcess(EngineSpec(backend="fake", fake_reply_tokens=args.reply_tokens)) as engine,
    ):
        manager, manager_url = start_manager(engine.url, Path(tmp) / "bench.sqlite")
        try:
            print(f"fake engine, {args.reply_tokens} tokens a reply, {args.turns} turns a session; latency in ms; "
                  "CPU: manager milliseconds per request")  # fmt: skip
            print(f"{'sessions':>8} | {'direct p50/p99':>15} | {'proxy p50/p99':>15} | {'added p50/p99':>15} | "
                  f"{'direct rps':>10} | {'proxy rps':>9} | {'CPU':>5}")  # fmt: skip
            for n in levels:
                run = (tok, n, args.turns, args.reply_tokens, args.min_requests)
                d, d_rps = asyncio.run(run_level("direct", engine.url, *run))
                before = cpu_s(manager.pid)
                p, p_rps = asyncio.run(run_level("proxy", manager_url, *run))
                cpu_ms = 1e3 * (cpu_s(manager.pid) - before) / len(p)
                d50, d99, p50, p99 = (1e3 * x for x in (pct(d, 50), pct(d, 99), pct(p, 50), pct(p, 99)))
                print(f"{n:>8} | {d50:6.1f} / {d99:6.1f} | {p50:6.1f} / {p99:6.1f} | {p50 - d50:6.1f} / "
                      f"{p99 - d99:6.1f} | {d_rps:10.0f} | {p_rps:9.0f} | {cpu_ms:5.2f}")  # fmt: skip
        finally:
            manager.terminate()
            manager.wait(timeout=30)


if __name__ == "__main__":
    main()
