"""Offered more than it can serve, does the trajectory manager shed load or collapse? (overload benchmark)

    python -m benchmarks.overload [--rates 200,400,...,2400] [--level-s 5] [--timeout-s 2] [--caps 0,32]
                                  [--target manager|anchor] [--quick] [--json FILE]

A fake engine that answers at once (`token_delay_s=0`) and the trajectory manager each get one core
(on a 2-core machine the engine shares its core with the load generator). The load generator is open
loop, as a crowd of agents is: it sends requests at a fixed offered rate whatever the answers do,
level after level at rising rates, each level starting once the last one's requests are done. A
client gives up after `--timeout-s` (the agents' patience), which closes its connection. Per level:
the rate actually sent, goodput (200s completed during the level, per second), 429s and errors
(timeouts, resets, other statuses) per second, p50 / p99 latency of the 200s, and the share of a core
the manager and the generator + engine used (the generator's core at 100% means the generator, not
the manager, set the limit). `srv wait`: the share of the level the server's event loop was ready to
run but waited for its core (other work on the machine took it): CPU + wait near 100% is a server
that could not keep up, CPU + wait well under 100% a server that had nothing to do.

Run twice: with the manager's in-flight cap off (`--max-in-flight 0`) and on (`--max-in-flight 32`,
beyond which it answers 429 with Retry-After); `--caps 0,32,default` adds a run with the manager's
default cap. A manager without that flag runs once, as it is.
Shedding: goodput holds near its peak (the knee) as the offered rate grows; collapse: it falls.
`--target anchor` puts the anchor proxy (benchmarks/anchor_proxy.py) under the same load instead, to
tell the manager's behaviour from that of any aiohttp proxy. `SYN drops`: connection attempts the
kernel dropped at a full listen queue during the level (machine-wide), each a client retry a second
later.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import (
    MODEL,
    conversation,
    core_plan,
    cpu_s,
    engine_token,
    listen_drops,
    pct,
    pinned,
    raise_fd_limit,
    run_queue_wait_s,
    serve_has_flag,
    start_anchor,
    start_manager,
    stderr_to,
)
from benchmarks.lean_http import LeanClient, request_bytes
from reference.engine.process import EngineProcess, EngineSpec

CAP_FLAG = "--max-in-flight"
TARGETS = ("manager", "anchor")


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
        }


def requests(client: LeanClient, n: int, turns: int, tag: str) -> list[bytes]:
    """Request i is turn i % turns of session `tag`-(i // turns), as bytes (built before the level starts)."""
    out = []
    for i in range(n):
        body = json.dumps({"model": MODEL, "messages": conversation(i // turns, i % turns), "max_tokens": 16})
        path = f"/s/{tag}-{i // turns}/v1/chat/completions"
        out.append(request_bytes("POST", client.host, client.port, path, body.encode()))
    return out


async def offer(client: LeanClient, rate: int, args, tag: str, pids: dict[str, int]) -> LevelResult:
    """Send `rate` requests a second for `args.level_s`, open loop; wait for every answer or timeout."""
    duration_s = args.level_s
    payloads = requests(client, int(rate * duration_s), args.turns, tag)
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
    return result


async def wait_idle(client: LeanClient) -> None:
    """Until the server answers /health again (it has worked off the last level's backlog)."""
    status = await client.send(request_bytes("GET", client.host, client.port, "/health"), 60.0)
    if status != 200:
        raise RuntimeError(f"the server answered /health with {status}")
    await asyncio.sleep(0.5)


async def run_levels(port: int, args, case: str, pids: dict[str, int]) -> list[dict]:
    client = LeanClient("127.0.0.1", port)
    levels = []
    try:
        for rate in args.rates:
            await wait_idle(client)
            result = await offer(client, rate, args, f"ol-{case}-{rate}", pids)
            levels.append(result.figures())
            print(row(levels[-1]), flush=True)
    finally:
        client.close()
    return levels


HEADER = (f"{'offered':>7} | {'sent':>5} | {'goodput':>7} | {'429':>5} | {'errors':>6} | {'p50 ms':>7} | "
          f"{'p99 ms':>7} | {'srv CPU':>7} | {'srv wait':>8} | {'gen+eng CPU':>11} | {'SYN drops':>9}")  # fmt: skip


def row(f: dict) -> str:
    cpu = f["cpu_share"]
    return (f"{f['offered_rps']:>7} | {f['sent_rps']:5.0f} | {f['goodput_rps']:7.0f} | {f['shed_rps']:5.0f} | "
            f"{f['error_rps']:6.0f} | {f['p50_ms']:7.1f} | {f['p99_ms']:7.1f} | {100 * cpu['proxy']:6.0f}% | "
            f"{100 * cpu['proxy_run_queue_wait']:7.0f}% | {100 * (cpu['generator'] + cpu['engine']):10.0f}% | "
            f"{f['listen_drops']:9}")  # fmt: skip


def summary(levels: list[dict]) -> dict:
    knee = max(levels, key=lambda f: f["goodput_rps"])
    last = levels[-1]
    return {"knee_offered_rps": knee["offered_rps"], "knee_goodput_rps": knee["goodput_rps"],
            "top_offered_rps": last["offered_rps"], "top_goodput_rps": last["goodput_rps"],
            "top_over_knee": last["goodput_rps"] / knee["goodput_rps"] if knee["goodput_rps"] else 0.0}  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", help="offered requests per second, one level each (default 200,400,...,2400; "
                    "quick: 400,1200,2400)")  # fmt: skip
    ap.add_argument("--level-s", type=float, help="seconds each level offers load (default 5; quick: 2)")
    ap.add_argument("--timeout-s", type=float, help="a client gives up after this long (default 2 s; quick: 1)")
    ap.add_argument("--caps", default="0,32",
                    help="the manager's --max-in-flight, a run each (0: no cap; 'default': flag left out)")  # fmt: skip
    ap.add_argument("--turns", type=int, default=4, help="requests per session (turn k resends k exchanges)")
    ap.add_argument("--target", choices=TARGETS, default="manager",
                    help="the server under load: the manager, or the anchor proxy (uncapped only)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="three short levels a run (under a minute in all)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args()
    full = (",".join(str(r) for r in range(200, 2401, 200)), 5.0, 2.0)
    defaults = ("400,1200,2400", 2.0, 1.0) if args.quick else full
    given = (args.rates, args.level_s, args.timeout_s)
    rates, args.level_s, args.timeout_s = (d if g is None else g for g, d in zip(given, defaults, strict=True))
    args.rates = [int(r) for r in rates.split(",")]
    return args


def cases(args) -> dict[str, list[str]]:
    """Each run's name and the flags the server gets. A manager without the flag runs without it only."""
    if args.target == "anchor":
        return {"anchor": []}
    if not serve_has_flag(CAP_FLAG):
        print(f"this manager has no {CAP_FLAG}: one run, without a cap")
        return {"uncapped": []}
    runs = {}
    for cap in args.caps.split(","):
        name = {"0": "uncapped", "default": f"default {CAP_FLAG}"}.get(cap, f"{CAP_FLAG} {cap}")
        runs[name] = [] if cap == "default" else [CAP_FLAG, str(int(cap))]
    return runs


def run_target(args, engine: EngineProcess, case: str, flags: list[str], cpus: set[int] | None, tmp: Path) -> dict:
    """Start the server under load on `cpus`, step through the rates, stop it; the case's figures."""
    token = engine_token(engine)
    with pinned(cpus):
        if args.target == "anchor":
            server = start_anchor(engine.url, tmp, token)
        else:
            server = start_manager(engine.url, tmp, token, flags)
    try:
        print(f"\n{args.target}, {case}\n{HEADER}")
        tag = case.replace(" ", "").replace("-", "")
        levels = asyncio.run(run_levels(server.port, args, tag, {"proxy": server.pid, "engine": engine.pid}))
    finally:
        server.close()
    result = {"flags": flags, "levels": levels, **summary(levels)}
    print(f"knee: goodput {result['knee_goodput_rps']:.0f}/s at {result['knee_offered_rps']} offered; at "
          f"{result['top_offered_rps']} offered: {result['top_goodput_rps']:.0f}/s "
          f"({100 * result['top_over_knee']:.0f}% of the knee)")  # fmt: skip
    return result


def main() -> None:
    args = parse_args()
    raise_fd_limit()
    proxy_cpus, engine_cpus, generator_cpus = core_plan(3)
    load = os.getloadavg()[0]  # other work on the machine at the start
    results = {}
    with tempfile.TemporaryDirectory() as tmp, pinned(generator_cpus):
        with pinned(engine_cpus), stderr_to(Path(tmp) / "engine.log"):
            engine = EngineProcess(EngineSpec(backend="fake", token_delay_s=0.0, fake_reply_tokens=16))
        try:
            print(f"cores: {args.target} {proxy_cpus}, engine {engine_cpus}, load generator {generator_cpus}; "
                  f"{args.level_s:g} s a level, clients give up after {args.timeout_s:g} s; rates in requests/s; "
                  f"load average {load:.1f}")  # fmt: skip
            for case, flags in cases(args).items():
                results[case] = run_target(args, engine, case, flags, proxy_cpus, Path(tmp))
        finally:
            engine.close()
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        config["load_average"] = load
        config["cores"] = {args.target: proxy_cpus, "engine": engine_cpus, "generator": generator_cpus}
        args.json.write_text(json.dumps({"config": config, "cases": results}, indent=2, default=sorted))


if __name__ == "__main__":
    main()
