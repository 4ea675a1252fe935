"""Offered more than it can serve, does the trajectory manager shed load or collapse? (overload benchmark)

    python -m benchmarks.overload [--rates 400,800,...,4000] [--level-s 5] [--timeout-s 2] [--caps 0,32,default]
                                  [--turns 4] [--output-words 0] [--share-core N] [--baseline DIR] [--redo N]
                                  [--repeats N] [--anchor] [--quick] [--json FILE]

A fake engine that answers at once (`token_delay_s=0`) and the trajectory manager each get one core
(on a 2-core machine the engine shares its core with the load generator). The load generator is open
loop, as a crowd of agents is: it sends requests at a fixed offered rate whatever the answers do,
level after level at rising rates, each level starting once the last one's requests are done. A
client gives up after `--timeout-s` (the agents' patience), which closes its connection.

The manager runs without shedding (`--max-in-flight 0 --max-loop-lag-s 0`), with a bare in-flight cap
(`--max-in-flight 32`, beyond which it answers 429 with Retry-After) and with its defaults (429 while
its event loop lags more than 0.1 s, and a cap of 4096 in flight); `--anchor` adds the anchor proxy
(benchmarks/anchor_proxy.py, no cap), to tell the manager's behaviour from any aiohttp proxy's. A manager
without the flags runs once, as it is. All the servers are up at once, on the same core, and take each
level in turn (the order alternating, each level starting once every server is idle again), so that
they share whatever else the machine is doing.

Per run and level: the rate actually sent, goodput (200s completed during the level, per second),
429s and errors (timeouts, resets, other statuses) per second, p50 / p99 latency of the 200s, the
share of a core the server and the generator + engine used (the generator's core at 100%: the
generator, not the server, set the limit), and `srv wait`, the share of the level the server's event
loop was ready to run but waited for its core (other work took it: CPU + wait near 100% is a server
that could not keep up, well under 100% one that had nothing to do). `SYN drops`: connection attempts
the kernel dropped at a full listen queue during the level (machine-wide), each retried a second
later. A level the generator could not offer in full (under 95% of its rate sent: other work took its
core) is run again with `--redo N`, up to N times. `early`: of the manager's 429s, the share it refused as
they arrived (from its /stats; "-" from a server that does not tell). Shedding: goodput holds near its peak
(the knee) as the offered rate grows; collapse: it falls.

The requests: by default short messages with 16 tokens out, the cheapest a manager serves (its knee is
then thousands a second, and the generator on a shared core reaches only about 1.4 times it). Two ways go
further. `--share-core N` pins N CPU-bound processes beside the servers, so that a busy server gets
1/(N+1) of its core and its knee falls to what the generator can offer several times over (with 2, 300-500
a second); the ratio of a refusal's cost to a served request's, which decides how well shedding holds,
stays that of small requests. `--output-words N` puts N words (a task's files, a tool's output) in every
user message, as agents' requests carry: at 300, with `--turns 1` (each request a new session, tokenised
whole), a request costs the manager 2.5-5 ms, its knee is 250-350 a second on a whole core, and the
rates can go many times past it. A 429 costs the manager about 25 us when it is refused as it arrives (0.1
ms through aiohttp's request handling, as a manager before that did: `--baseline` loads one beside this
one).

One level's goodput moves by a fifth to a third from repeat to repeat at the same rate on a shared machine,
and the knee is the best level: `--repeats N` offers the whole list of rates N times, round after round, and
counts each rate by its median level, with the range beside it; and, since the machine's speed also drifts
over minutes, each rate's levels divided by the same round's level at the knee's rate, seconds apart ("paired
by round": the median of those ratios and their range). Every level opens sessions of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import (
    MODEL,
    ServerProcess,
    conversation,
    core_plan,
    cpu_s,
    engine_token,
    listen_drops,
    pct,
    pinned,
    raise_fd_limit,
    run_benchmark,
    run_queue_wait_s,
    serve_has_flag,
    start_anchor,
    start_manager,
    stderr_to,
)
from benchmarks.lean_http import LeanClient, request_bytes
from core.cli import at_least, greater_than, list_of
from reference.engine.fake import FakeConfig
from reference.engine.process import EngineProcess, EngineSpec

CAP_FLAG = "--max-in-flight"
LAG_FLAG = "--max-loop-lag-s"  # shedding while the manager's event loop lags


@dataclass
class LevelResult:
    offered_rps: int
    duration_s: float
    sent_s: float = 0.0  # how long sending took (longer than duration_s: the generator fell behind)
    statuses: Counter = field(default_factory=Counter)  # status (or "timeout", "error") -> requests
    ok_in_window: int = 0  # 200s completed before the level's end
    ok_latency_s: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # process -> share of a core during the level
    listen_drops: int = 0  # connection attempts dropped by a full listen queue (the whole machine)
    on_arrival: float | None = None  # of the server's 429s, the share refused as they arrived (None: not told)

    def figures(self) -> dict:
        sent = sum(self.statuses.values())
        errors = sent - self.statuses[200] - self.statuses[429]
        return {
            "offered_rps": self.offered_rps,
            "sent_rps": sent / self.sent_s if self.sent_s else 0.0,
            "goodput_rps": self.ok_in_window / self.duration_s,
            "shed_rps": self.statuses[429] / self.duration_s,
            "error_rps": errors / self.duration_s,
            "p50_ms": 1e3 * pct(self.ok_latency_s, 50),
            "p99_ms": 1e3 * pct(self.ok_latency_s, 99),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
            "cpu_share": self.cpu,
            "listen_drops": self.listen_drops,
            "on_arrival": self.on_arrival,
        }


def requests(client: LeanClient, n: int, turns: int, tag: str, output_words: int = 0) -> list[bytes]:
    """Request i is turn i % turns of session `tag`-(i // turns), as bytes (built before the level starts)."""
    out = []
    for i in range(n):
        messages = conversation(i // turns, i % turns, output_words)
        body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 16})
        path = f"/s/{tag}-{i // turns}/v1/chat/completions"
        out.append(request_bytes("POST", client.host, client.port, path, body.encode()))
    return out


async def offer(client: LeanClient, rate: int, args, tag: str, pids: dict[str, int]) -> LevelResult:
    """Send `rate` requests a second for `args.level_s`, open loop; wait for every answer or timeout."""
    duration_s = args.level_s
    payloads = requests(client, int(rate * duration_s), args.turns, tag, args.output_words)
    result = LevelResult(rate, duration_s)
    tasks: set[asyncio.Task] = set()

    async def one(i: int) -> None:
        sent = time.perf_counter()
        status = await client.send(payloads[i], args.timeout_s)
        done = time.perf_counter()
        result.statuses[status] += 1
        if status == 200:
            result.ok_latency_s.append(done - sent)
            result.ok_in_window += done - start <= duration_s

    shed_before = await shed_counts(client)
    cpu_before = {name: cpu_s(pid) for name, pid in pids.items()}
    wait_before = run_queue_wait_s(pids["proxy"])
    gen_before, drops_before = time.process_time(), listen_drops()
    start = time.perf_counter()
    i = 0
    while i < len(payloads):
        due = min(len(payloads), int((time.perf_counter() - start) * rate) + 1)
        for j in range(i, due):
            task = asyncio.create_task(one(j))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        i = due
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
    result.sent_s = time.perf_counter() - start
    await asyncio.sleep(max(0.0, start + duration_s - time.perf_counter()))
    wall = time.perf_counter() - start
    result.cpu = {name: (cpu_s(pid) - cpu_before[name]) / wall for name, pid in pids.items()}
    result.cpu["generator"] = (time.process_time() - gen_before) / wall
    result.cpu["proxy_run_queue_wait"] = (run_queue_wait_s(pids["proxy"]) - wait_before) / wall
    await asyncio.gather(*tasks)
    result.listen_drops = listen_drops() - drops_before
    shed_after = await shed_counts(client)
    if shed_before is not None and shed_after is not None and shed_after[0] > shed_before[0]:
        result.on_arrival = (shed_after[1] - shed_before[1]) / (shed_after[0] - shed_before[0])
    return result


async def shed_counts(client: LeanClient) -> tuple[int, int] | None:
    """The manager's 429s so far and those refused as they arrived (/stats), or None from a server that does
    not tell them apart."""
    status, body = await client.fetch(request_bytes("GET", client.host, client.port, "/stats"), 60.0)
    try:
        stats = json.loads(body) if status == 200 else {}
    except ValueError:
        return None
    return (stats["shed"], stats["shed_on_arrival"]) if "shed_on_arrival" in stats else None


async def wait_idle(client: LeanClient, servers: dict[str, ServerProcess], timeout_s: float = 60.0) -> None:
    """Until the server answers /health and every server has worked off its backlog (each used under 5% of a
    core over a quarter second): a server still busy with the last level's abandoned requests would take
    the core from the next run."""
    status = await client.send(request_bytes("GET", client.host, client.port, "/health"), 60.0)
    if status != 200:
        raise RuntimeError(f"the server answered /health with {status}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = {name: s.cpu_s() for name, s in servers.items()}
        await asyncio.sleep(0.25)
        if all(s.cpu_s() - before[name] < 0.0125 for name, s in servers.items()):
            return


async def run_levels(servers: dict[str, ServerProcess], args, engine_pid: int) -> dict[str, list[dict]]:
    """Each rate on each server in turn (the order alternating from level to level), so that the runs
    share whatever else the machine is doing."""
    clients = {name: LeanClient("127.0.0.1", server.port) for name, server in servers.items()}
    levels: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        for k, rate in enumerate(args.rates * args.repeats):  # each round of rates in turn
            for name in list(servers) if k % 2 == 0 else list(reversed(servers)):
                pids = {"proxy": servers[name].pid, "engine": engine_pid}
                for attempt in range(args.redo + 1):
                    await wait_idle(clients[name], servers)
                    tag = f"ol-{re.sub(r'[^A-Za-z0-9]', '', name)}-{k}-{rate}-{attempt}"  # new sessions every level
                    figures = (await offer(clients[name], rate, args, tag, pids)).figures()
                    if figures["sent_rps"] >= 0.95 * rate or attempt == args.redo:
                        break
                    print(f"{row(name, figures)}  (the generator fell behind: again)", flush=True)
                levels[name].append(figures | {"round": k // len(args.rates)})
                print(row(name, figures), flush=True)
    finally:
        for client in clients.values():
            client.close()
    return levels


HEADER = (
    f"{'run':>11} | {'offered':>7} | {'sent':>5} | {'goodput':>7} | {'429':>5} | {'errors':>6} | "
    f"{'p50 ms':>7} | {'p99 ms':>7} | {'srv CPU':>7} | {'srv wait':>8} | {'gen+eng CPU':>11} | "
    f"{'SYN drops':>9} | {'early':>5}"
)


def row(name: str, f: dict) -> str:
    cpu = f["cpu_share"]
    early = "-" if f["on_arrival"] is None else f"{100 * f['on_arrival']:.0f}%"
    return (
        f"{name:>11} | {f['offered_rps']:>7} | {f['sent_rps']:5.0f} | {f['goodput_rps']:7.0f} | "
        f"{f['shed_rps']:5.0f} | {f['error_rps']:6.0f} | {f['p50_ms']:7.1f} | {f['p99_ms']:7.1f} | "
        f"{100 * cpu['proxy']:6.0f}% | {100 * cpu['proxy_run_queue_wait']:7.0f}% | "
        f"{100 * (cpu['generator'] + cpu['engine']):10.0f}% | {f['listen_drops']:9} | {early:>5}"
    )


def per_core(f: dict) -> float:
    """Goodput per core of the server's CPU: how well the CPU the server got went to answers (the share of a core
    it gets changes with whatever else the machine runs)."""
    return f["goodput_rps"] / f["cpu_share"]["proxy"] if f["cpu_share"]["proxy"] else 0.0


def summary(levels: list[dict]) -> dict:
    """The knee (the offered rate of most goodput, `knee_times` its offered rate over its goodput) and every rate
    offered beyond it (`beyond`) and short of it (`below`): its offered rate as a multiple of the knee's goodput,
    and its goodput as a share of the knee's, raw and per core of the server's CPU. The knee may be the highest
    rate offered (`beyond` empty): goodput had not fallen yet, at `knee_times` its own goodput. A rate
    offered several times (`--repeats`) counts by its median level and gives the range: one level's goodput
    moves by a fifth from repeat to repeat on this machine, and the best of several single levels, taken as the
    knee, would make every other level look worse than it is.

    Paired by round as well: the machine's speed drifts over minutes (the manager's CPU for the same request moved
    between 2.5 and 5 ms from level to level), so each round's level at a rate is divided by the same round's level
    at the knee's rate, seconds apart, and the median of those ratios (with their range) is `of_knee_paired`, a
    ratio measured in one stretch rather than across the run (None unless both were offered in two rounds or
    more)."""
    by_rate: dict[int, list[dict]] = {}
    for f in levels:
        by_rate.setdefault(f["offered_rps"], []).append(f)
    rates = {
        rate: {
            "goodput_rps": statistics.median(f["goodput_rps"] for f in group),
            "per_core": statistics.median(per_core(f) for f in group),
            "range_rps": [min(f["goodput_rps"] for f in group), max(f["goodput_rps"] for f in group)],
            "levels": len(group),
        }
        for rate, group in by_rate.items()
    }
    knee_rate = max(rates, key=lambda r: rates[r]["goodput_rps"])
    knee = rates[knee_rate]
    out = {
        "knee_offered_rps": knee_rate,
        "knee_goodput_rps": knee["goodput_rps"],
        "knee_times": knee_rate / knee["goodput_rps"] if knee["goodput_rps"] else 0.0,
        "knee_range_rps": knee["range_rps"],
        "knee_levels": knee["levels"],
        "beyond": [],
        "below": [],
    }
    if not knee["goodput_rps"]:
        return out
    for rate, r in sorted(rates.items()):
        if rate != knee_rate:
            out["beyond" if rate > knee_rate else "below"].append(
                {
                    "offered_rps": rate,
                    "times_knee": rate / knee["goodput_rps"],
                    "goodput_rps": r["goodput_rps"],
                    "range_rps": r["range_rps"],
                    "of_knee": r["goodput_rps"] / knee["goodput_rps"],
                    "per_core_of_knee": r["per_core"] / knee["per_core"] if knee["per_core"] else 0.0,
                    **paired(by_rate[rate], by_rate[knee_rate]),
                }
            )
    return out


def paired(levels: list[dict], knees: list[dict]) -> dict:
    """`of_knee_paired`: the median over rounds of a level's goodput over the same round's level at the knee's rate
    (`paired_range`: their lowest and highest); None where fewer than two rounds have both. A level's round is its
    `round` (without one, its place among the rate's levels); a rate listed twice in a round counts by its median."""

    def medians_by_round(group: list[dict]) -> dict[int, float]:
        rounds: dict[int, list[float]] = {}
        for i, f in enumerate(group):
            rounds.setdefault(f.get("round", i), []).append(f["goodput_rps"])
        return {r: statistics.median(g) for r, g in rounds.items()}

    mine, knee = medians_by_round(levels), medians_by_round(knees)
    ratios = [mine[r] / knee[r] for r in sorted(mine.keys() & knee.keys()) if knee[r]]
    if len(ratios) < 2:
        return {"of_knee_paired": None, "paired_range": None}
    return {"of_knee_paired": statistics.median(ratios), "paired_range": [min(ratios), max(ratios)]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rates",
        type=list_of(at_least(1)),
        help="offered requests per second, one level each (default 400,800,...,4000; quick: 800,2400,4000)",
    )
    ap.add_argument("--level-s", type=greater_than(0), help="seconds each level offers load (default 5; quick: 2)")
    ap.add_argument(
        "--timeout-s", type=greater_than(0), help="a client gives up after this long (default 2 s; quick: 1)"
    )
    ap.add_argument(
        "--caps",
        default="0,32,default",
        help="runs of the manager: N is --max-in-flight N with lag shedding off (0: no shedding at "
        "all); lagX: --max-loop-lag-s X; 'default': the manager's defaults",
    )
    ap.add_argument("--turns", type=int, default=4, help="requests per session (turn k resends k exchanges)")
    ap.add_argument(
        "--output-words",
        type=int,
        default=0,
        help="words of a task's files or a tool's output in every user message (an agent's "
        "observations; 0: short messages, the cheapest requests to serve)",
    )
    ap.add_argument(
        "--share-core",
        type=int,
        default=0,
        metavar="N",
        help="N CPU-bound processes pinned beside the servers, which then get 1/(N+1) of their core: with 2, the "
        "load generator offers the manager 4 times its knee and more (default 0: a whole core; rates default "
        "to 500,750,1000,1500,2000,3000 with N > 0)",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="also each manager run from the checkout DIR (with the same serve flags; e.g. the commit before a "
        "change: git archive COMMIT | tar -x -C DIR), named '<run> base', interleaved with this checkout's",
    )
    ap.add_argument(
        "--redo",
        type=int,
        default=0,
        metavar="N",
        help="run a level again, up to N times, when the generator sent under 95%% of its rate (other work on the "
        "machine took its core; default 0)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="offer the whole list of rates N times, round after round, and count each rate by its median level "
        "(default 1)",
    )
    ap.add_argument("--anchor", action="store_true", help="also a run of the anchor proxy (no cap), for reference")
    ap.add_argument("--quick", action="store_true", help="three short levels a run (under a minute in all)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args()
    shared = [500, 750, 1000, 1500, 2000, 3000]  # a share of a core: the knee about 450 with 2
    full = (shared if args.share_core > 0 else list(range(400, 4001, 400)), 5.0, 2.0)
    defaults = ([800, 2400, 4000], 2.0, 1.0) if args.quick else full
    given = (args.rates, args.level_s, args.timeout_s)
    args.rates, args.level_s, args.timeout_s = (d if g is None else g for g, d in zip(given, defaults, strict=True))
    if min(args.output_words, args.share_core, args.redo) < 0 or min(args.turns, args.repeats) < 1:
        ap.error(
            f"--output-words, --share-core and --redo must be >= 0 and --turns and --repeats >= 1, got "
            f"{args.output_words}, {args.share_core}, {args.redo}, {args.turns} and {args.repeats}"
        )
    if args.baseline is not None and not (args.baseline / "reference" / "__main__.py").is_file():
        ap.error(f"--baseline {args.baseline} is not a checkout of this project (no reference/__main__.py)")
    return args


@dataclass(frozen=True)
class Run:
    name: str
    server: str  # "manager" or "anchor"
    flags: tuple[str, ...] = ()
    source: Path | None = None  # the checkout a manager runs from (None: this one)


def runs(args) -> list[Run]:
    """The servers to load: the manager once per cap (once as it is, if it has no cap flag), the anchor."""
    out = []
    no_lag = (LAG_FLAG, "0") if serve_has_flag(LAG_FLAG) else ()  # a cap alone: lag shedding off
    if serve_has_flag(CAP_FLAG):
        for cap in args.caps.split(","):
            if cap.startswith("lag"):  # lag shedding at another threshold
                out.append(Run(f"lag {cap[3:]} s", "manager", (LAG_FLAG, str(float(cap[3:])))))
                continue
            name = {"0": "no shedding", "default": "default (lag + cap)"}.get(cap, f"cap {cap}")
            flags = () if cap == "default" else (CAP_FLAG, str(int(cap)), *no_lag)
            out.append(Run(name, "manager", flags))
    else:
        print(f"this manager has no {CAP_FLAG}: one manager run, without a cap")
        out.append(Run("uncapped", "manager"))
    if args.baseline is not None:  # the same runs of the other checkout's manager, named "<run> base"
        out = [r for run in out for r in (run, Run(f"{run.name} base", "manager", run.flags, args.baseline))]
    return [*out, Run("anchor", "anchor")] if args.anchor else out


def start(run: Run, engine: EngineProcess, tmp: Path) -> ServerProcess:
    if run.server == "anchor":
        return start_anchor(engine.url, tmp, engine_token(engine))
    return start_manager(engine.url, tmp, engine_token(engine), run.flags, source=run.source)


@contextmanager
def spinners(n: int, cpus: set[int] | None) -> Iterator[None]:
    """`n` CPU-bound processes on `cpus` for the block: a server there gets 1/(n + 1) of its core when busy."""
    procs = []
    try:
        with pinned(cpus):
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


def main() -> None:
    args = parse_args()
    raise_fd_limit()
    proxy_cpus, engine_cpus, generator_cpus = core_plan(3)
    load = os.getloadavg()[0]  # other work on the machine at the start
    plan = runs(args)
    servers: dict[str, ServerProcess] = {}
    with tempfile.TemporaryDirectory() as tmp, pinned(generator_cpus), spinners(args.share_core, proxy_cpus):
        with pinned(engine_cpus), stderr_to(Path(tmp) / "engine.log"):
            engine = EngineProcess(EngineSpec(backend="fake", options=FakeConfig(token_delay_s=0.0, reply_tokens=16)))
        try:
            with pinned(proxy_cpus):
                for run in plan:
                    servers[run.name] = start(run, engine, Path(tmp))
            shared = f" (with {args.share_core} CPU-bound processes)" if args.share_core else ""
            print(
                f"cores: servers {proxy_cpus}{shared}, engine {engine_cpus}, load generator {generator_cpus}; "
                f"{args.level_s:g} s a level, clients give up after {args.timeout_s:g} s; rates in requests/s; "
                f"load average {load:.1f}\n{HEADER}"
            )
            levels = asyncio.run(run_levels(servers, args, engine.pid))
        finally:
            for server in servers.values():
                server.close()
            engine.close()
    cores = {"servers": proxy_cpus, "engine": engine_cpus, "generator": generator_cpus}
    report(args, plan, levels, {"load_average": load, "cores": cores})


def _jsonable(value) -> list | str:
    return str(value) if isinstance(value, Path) else sorted(value)  # the baseline's path, sets of cores


def spread(bounds: list[float]) -> str:
    """' (low-high)' of a rate offered more than once, else nothing."""
    low, high = bounds
    return f" ({low:.0f}-{high:.0f})" if high > low else ""


def by_round(a: dict) -> str:
    """'; paired by round M% (low-high%)' where the rate was paired with the knee's over rounds, else nothing."""
    if a["of_knee_paired"] is None:
        return ""
    low, high = a["paired_range"]
    return f"; paired by round {100 * a['of_knee_paired']:.0f}%, {100 * low:.0f}-{100 * high:.0f}%"


def report(args, plan: list[Run], levels: dict[str, list[dict]], machine: dict) -> None:
    """Each run's knee and its goodput at multiples of it; the levels where the generator fell behind; the JSON
    file."""
    results = {run.name: {"flags": run.flags, "levels": levels[run.name], **summary(levels[run.name])} for run in plan}
    for name, r in results.items():
        where = "; ".join(
            f"{a['offered_rps']} ({a['times_knee']:.1f}x) {a['goodput_rps']:.0f}/s{spread(a['range_rps'])}, "
            f"{100 * a['of_knee']:.0f}% (per core {100 * a['per_core_of_knee']:.0f}%{by_round(a)})"
            for a in (*r["below"], *r["beyond"])
        )
        knee = f"{r['knee_goodput_rps']:.0f}/s{spread(r['knee_range_rps'])}"
        median = f"medians of {args.repeats} levels; " if args.repeats > 1 else ""
        top = "" if r["beyond"] else ", the highest rate offered"
        at = f"{r['knee_offered_rps']} offered ({median}{r['knee_times']:.1f}x its goodput{top})"
        print(f"{name}: knee {knee} at {at}; {where}")
    behind = sorted(
        {f["offered_rps"] for r in results.values() for f in r["levels"] if f["sent_rps"] < 0.95 * f["offered_rps"]}
    )
    if behind:  # other work took the generator's core: those levels offered less than they say
        print(f"the generator sent under 95% of the offered rate at {', '.join(map(str, behind))} requests/s")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"} | machine
        args.json.write_text(json.dumps({"config": config, "runs": results}, indent=2, default=_jsonable))


if __name__ == "__main__":
    run_benchmark(main)
