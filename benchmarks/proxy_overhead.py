"""What does the trajectory manager add to an engine call, and how much of it is recording? (proxy overhead)

    python -m benchmarks.proxy_overhead [--levels 1,64,256] [--turns 4] [--reply-tokens 16] [--output-words 0]
                                        [--rounds 2] [--quick] [--json FILE] [--no-pin] [--profile DIR]

Starts a fast fake engine in its own process, and in two more the trajectory manager (`python -m
reference serve --engine-url ...`) and the anchor (`benchmarks/anchor_proxy.py`: a minimal OpenAI proxy
that parses, renders, calls the engine and decodes as the manager does, but records nothing). At each
concurrency level that many sessions each run multi-turn conversations straight against the engine
(the same token ids, rendered here), through the anchor and through the manager; the two proxies take
turns (`--rounds`), so a drift in the machine's speed hits both. Prints p50 / p99 latency of each path,
its requests per second, each proxy's CPU per request (user + system of its process, from /proc) and
the ratio manager / anchor: the cost of recording (issue 7's goal: at most 1.3). The highest
requests/s over the levels is each path's ceiling (a closed loop: each session sends its next turn
when the last is answered).

By default the proxy under test has a core of its own and the engine and the load generator share the
others (`--no-pin` lets the scheduler place everything); `busy` is the share of its core the proxy
used, so a ceiling reached near 100% busy is the proxy's own, not the load generator's. The load
generator sends pre-rendered bytes over keep-alive connections (benchmarks/lean_http.py), so that it
costs far less per request than what it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    MODEL,
    ServerProcess,
    conversation,
    cpu_s,
    engine_headers,
    engine_token,
    main_thread_cpu_s,
    pct,
    pinned,
    run_benchmark,
    serve_has_flag,
    start_anchor,
    start_manager,
    stderr_to,
)
from benchmarks.lean_http import LeanClient, request_bytes
from core.cli import at_least, list_of
from reference.engine.fake import FakeConfig
from reference.engine.process import EngineProcess, EngineSpec
from reference.manager.chat import ChatRenderer
from reference.tokenizer import default_tokenizer

PROXIES = ("anchor", "manager")
TIMEOUT_S = 600.0  # a closed-loop request that takes longer is a failure, not a figure


# A closed loop at 256 sessions saturates the manager's core on purpose: what is measured is the cost of a
# request, so the manager's overload shedding (429s, see benchmarks/overload.py) is turned off here.
def no_shedding() -> tuple[str, ...]:
    return ("--max-in-flight", "0", "--max-loop-lag-s", "0") if serve_has_flag("--max-loop-lag-s") else ()


def direct_request(port: int, token: str | None, tok, reply: int, words: int = 0):
    """Turn `turn` of session `session` as an engine call, rendered here as the proxies render it."""
    headers = "".join(f"{k}: {v}\r\n" for k, v in engine_headers(token).items())
    stop = [tok.im_end_id, tok.eos_token_id]

    def build(session: int, turn: int) -> bytes:
        body = {
            "request_id": f"d{session}.{turn}.{time.monotonic_ns()}",
            "prompt_token_ids": ChatRenderer(tok).render(conversation(session, turn, words)),
            "params": {"max_tokens": reply, "stop_token_ids": stop},
        }
        return request_bytes("POST", "127.0.0.1", port, "/generate", json.dumps(body).encode(), headers)

    return build


def proxy_request(port: int, reply: int, words: int = 0):
    """Turn `turn` of session `session` as an OpenAI chat request."""

    def build(session: int, turn: int) -> bytes:
        body = {"model": MODEL, "messages": conversation(session, turn, words), "max_tokens": reply}
        return request_bytes(
            "POST", "127.0.0.1", port, f"/s/bench-{session}/v1/chat/completions", json.dumps(body).encode()
        )

    return build


def check_answer(path: str, status: int | str, body: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"{path} answered {status}: {body[:200]!r}")
    answered = b'"finish"' in body if path == "direct" else "choices" in json.loads(body)
    if not answered:
        raise RuntimeError(f"{path} answered 200 with {body[:200]!r}")


async def run_level(
    path: str, port: int, build, concurrency: int, turns: int, min_requests: int, first_session: int
) -> tuple[list[float], float]:
    """`concurrency` workers, each running sessions of `turns` turns one after another (closed loop),
    until at least `min_requests` requests were made. Returns the latencies and the wall time."""
    lat: list[float] = []
    sessions_per_worker = max(1, -(-min_requests // (concurrency * turns)))
    client = LeanClient("127.0.0.1", port)

    async def worker(w: int) -> None:
        for k in range(sessions_per_worker):
            session = first_session + w * sessions_per_worker + k
            for turn in range(turns):
                data = build(session, turn)
                start = time.perf_counter()
                status, body = await client.fetch(data, TIMEOUT_S)
                lat.append(time.perf_counter() - start)
                check_answer(path, status, body)

    try:
        await client.warm(concurrency)  # connections first: the timed run measures requests, not a SYN storm
        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - start
    finally:
        client.close()
    return lat, wall


class PathStats:
    """One path's requests at one level, summed over rounds."""

    def __init__(self) -> None:
        self.lat: list[float] = []
        self.wall_s = 0.0
        self.cpu_s = {"proxy": 0.0, "proxy_threads": 0.0, "engine": 0.0}
        self.rounds_ms: list[float] = []  # the proxy's CPU per request in each round

    def add(self, lat: list[float], wall_s: float, before: dict[str, float], after: dict[str, float]) -> None:
        self.lat += lat
        self.wall_s += wall_s
        for name in self.cpu_s:
            self.cpu_s[name] += after[name] - before[name]
        self.rounds_ms.append(1e3 * (after["proxy"] - before["proxy"]) / len(lat))

    def figures(self) -> dict:
        n, cpu = len(self.lat), self.cpu_s
        return {
            "requests": n,
            "p50_ms": 1e3 * pct(self.lat, 50),
            "p99_ms": 1e3 * pct(self.lat, 99),
            "rps": n / self.wall_s,
            "cpu_ms_per_request": 1e3 * cpu["proxy"] / n,
            "worker_thread_cpu_ms_per_request": 1e3 * cpu["proxy_threads"] / n,  # off the event loop
            "busy": cpu["proxy"] / self.wall_s,  # share of one core
            "engine_cpu_ms_per_request": 1e3 * cpu["engine"] / n,
        }


def cpu_now(server: ServerProcess | None, engine: EngineProcess) -> dict[str, float]:
    if server is None:
        return {"proxy": 0.0, "proxy_threads": 0.0, "engine": cpu_s(engine.pid)}
    total = server.cpu_s()
    return {"proxy": total, "proxy_threads": total - main_thread_cpu_s(server.pid), "engine": cpu_s(engine.pid)}


def measure_level(args, tok, engine, servers: dict[str, ServerProcess], n: int, level_index: int) -> dict:
    stats = {path: PathStats() for path in ("direct", *PROXIES)}
    per_round = max(1, args.min_requests // args.rounds)
    order = ["direct"]
    for r in range(args.rounds):  # the proxies alternate which goes first
        order += list(PROXIES) if r % 2 == 0 else list(reversed(PROXIES))
    for k, path in enumerate(order):
        server = servers.get(path)
        if server is None:
            port, build = (
                engine.port,
                direct_request(engine.port, engine_token(engine), tok, args.reply_tokens, args.output_words),
            )
        else:
            port, build = server.port, proxy_request(server.port, args.reply_tokens, args.output_words)
        first_session = (level_index * 100 + k) * 1_000_000  # unique sessions per run
        before = cpu_now(server, engine)
        lat, wall = asyncio.run(
            run_level(path, port, build, n, args.turns, per_round if server else args.min_requests, first_session)
        )
        stats[path].add(lat, wall, before, cpu_now(server, engine))
    figures = {path: s.figures() for path, s in stats.items()}
    figures["cpu_ratio"] = figures["manager"]["cpu_ms_per_request"] / figures["anchor"]["cpu_ms_per_request"]
    # each round's ratio (the manager's CPU per request over the anchor's in the same round): how much the
    # machine moves the figure within one run
    figures["cpu_ratio_rounds"] = [
        m / a if a else None for m, a in zip(stats["manager"].rounds_ms, stats["anchor"].rounds_ms, strict=True)
    ]
    return figures


HEADER = (
    f"{'sessions':>8} | {'direct p50/p99':>15} | {'anchor p50/p99':>15} | {'manager p50/p99':>15} | "
    f"{'req/s dir/anc/mgr':>18} | {'CPU ms anc/mgr':>14} | {'ratio':>5} | {'rounds':>9} | {'mgr thr':>7} | "
    f"{'busy anc/mgr':>12}"
)


def legend(args, proxy_cpus: set[int] | None, load: float) -> str:
    return (
        f"fake engine, {args.reply_tokens} tokens a reply, {args.turns} turns a session; latency in ms; CPU: "
        f"milliseconds per request of the proxy's process; ratio: manager / anchor (rounds: its lowest and "
        f"highest in single rounds, the machine's noise); mgr thr: the part of the "
        f"manager's CPU spent in its worker threads; busy: share of a core; proxy cores "
        f"{sorted(proxy_cpus) if proxy_cpus else 'any'}; load average {load:.1f}"
    )


def row(n: int, f: dict) -> str:
    d, a, m = f["direct"], f["anchor"], f["manager"]
    lat = " | ".join(f"{x['p50_ms']:6.1f} / {x['p99_ms']:6.1f}" for x in (d, a, m))
    rounds = [r for r in f["cpu_ratio_rounds"] if r is not None]
    spread = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-"
    return (
        f"{n:>8} | {lat} | {d['rps']:6.0f}{a['rps']:6.0f}{m['rps']:6.0f} | "
        f"{a['cpu_ms_per_request']:6.2f} {m['cpu_ms_per_request']:6.2f} | {f['cpu_ratio']:5.2f} | {spread:>9} | "
        f"{m['worker_thread_cpu_ms_per_request']:7.2f} | "
        f"{100 * a['busy']:5.0f}% {100 * m['busy']:4.0f}%"
    )


def cpu_plan(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(cores of the proxy under test, cores of the engine and load generator); None: unpinned."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return None, None
    return {cores[-1]}, set(cores[:-1])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--levels",
        type=list_of(at_least(1)),
        default=[1, 64, 256],
        help="concurrent sessions per level (comma-separated)",
    )
    ap.add_argument("--turns", type=int, default=4, help="requests per session")
    ap.add_argument("--reply-tokens", type=at_least(1), default=16)
    ap.add_argument(
        "--output-words",
        type=int,
        default=0,
        help="words of a task's files or a tool's output in every user message, as agents send (default 0)",
    )
    ap.add_argument("--min-requests", type=at_least(1), help="requests per level and path, at least (3000; quick: 200)")
    ap.add_argument("--rounds", type=at_least(1), help="turns each proxy takes per level, alternating (4; quick: 1)")
    ap.add_argument("--quick", action="store_true", help="fewer requests and one round (well under a minute)")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not give the proxy a core of its own")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--profile", type=Path, help="run both proxies under cProfile; DIR/manager.prof, DIR/anchor.prof")
    args = ap.parse_args()
    if args.output_words < 0 or args.turns < 1:
        ap.error(f"--output-words must be >= 0 and --turns >= 1, got {args.output_words} and {args.turns}")
    args.min_requests = args.min_requests or (200 if args.quick else 3000)
    args.rounds = args.rounds or (1 if args.quick else 4)
    return args


def main() -> None:
    args = parse_args()
    tok = default_tokenizer()
    levels = args.levels
    proxy_cpus, other_cpus = cpu_plan(args.pin)
    load = os.getloadavg()[0]  # other work on the machine at the start
    results = []
    servers: dict[str, ServerProcess] = {}
    with tempfile.TemporaryDirectory() as tmp, pinned(other_cpus):
        with stderr_to(Path(tmp) / "engine.log"):
            engine = EngineProcess(EngineSpec(backend="fake", options=FakeConfig(reply_tokens=args.reply_tokens)))
        try:
            token = engine_token(engine)
            with pinned(proxy_cpus):
                servers["anchor"] = start_anchor(engine.url, Path(tmp), token, profile_path(args, "anchor"))
                servers["manager"] = start_manager(
                    engine.url, Path(tmp), token, no_shedding(), profile=profile_path(args, "manager")
                )
            print(legend(args, proxy_cpus, load))
            if args.profile:
                print("both proxies run under cProfile: their CPU and latency are inflated")
            print(HEADER)
            for i, n in enumerate(levels):
                figures = measure_level(args, tok, engine, servers, n, i)
                results.append({"sessions": n, **figures})
                print(row(n, figures), flush=True)
        finally:
            for server in servers.values():
                server.close()
            engine.close()
    report(args, results, {"proxy_cores": sorted(proxy_cpus) if proxy_cpus else None, "load_average": load})


def report(args, results: list[dict], machine: dict) -> None:
    """The ceilings, the JSON file and the manager's profile, after the table."""
    ceiling = {p: max(r[p]["rps"] for r in results) for p in ("direct", *PROXIES)}
    # What one core could serve at the last level's CPU cost: the ceiling a proxy would reach if the
    # engine and load generator kept up (they share the other cores here).
    capacity = {p: 1e3 / results[-1][p]["cpu_ms_per_request"] for p in PROXIES}
    print(
        "ceiling (highest req/s over the levels): "
        + ", ".join(f"{p} {v:.0f}" for p, v in ceiling.items())
        + "; one core's worth at the last level's CPU cost: "
        + ", ".join(f"{p} {v:.0f}" for p, v in capacity.items())
    )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "profile")}
        config.update(machine, cpus=os.cpu_count())
        out = {"config": config, "levels": results, "ceiling_rps": ceiling, "one_core_capacity_rps": capacity}
        args.json.write_text(json.dumps(out, indent=2))
    if args.profile:
        pstats.Stats(str(profile_path(args, "manager"))).sort_stats("tottime").print_stats(25)


def profile_path(args, proxy: str) -> Path | None:
    if args.profile is None:
        return None
    args.profile.mkdir(parents=True, exist_ok=True)
    return args.profile / f"{proxy}.prof"


if __name__ == "__main__":
    run_benchmark(main)
