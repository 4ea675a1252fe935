"""Big request bodies against the trajectory manager's memory: `python -m benchmarks.big_bodies [--bodies 6] [--mib 7]`.

Starts `python -m reference serve` with the fake engine, sends `--bodies` chat requests of `--mib` MiB each at once
(one message of plain words: far over any context), and prints each answer's status and seconds, whether `/health`
answered meanwhile, and the manager's resident memory before, at its peak (sampled every 20 ms) and after. The
audit this answers: six 7 MiB messages took a manager to 6 GB and left 4 GB behind, each tokenised only to be
refused.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.harness import free_port, run_benchmark


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def post(url: str, body: bytes) -> tuple[int, float]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            r.read()
            return r.status, time.perf_counter() - start
    except urllib.error.HTTPError as e:
        return e.code, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bodies", type=int, default=6, help="requests sent at once (6)")
    p.add_argument("--mib", type=float, default=7.0, help="MiB a body (7; the manager takes at most 8)")
    args = p.parse_args(argv)
    if args.bodies < 1 or not 0 < args.mib <= 8:
        p.error(f"--bodies must be >= 1 and --mib in (0, 8], got {args.bodies} and {args.mib}")
    port = free_port()
    with tempfile.TemporaryDirectory() as root:
        argv = [
            sys.executable,
            "-m",
            "reference",
            "serve",
            "--backend",
            "fake",
            "--port",
            str(port),
            "--store",
            f"{root}/t.sqlite",
            "--no-admin-token",
        ]
        proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=1).read()
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit("the manager did not start") from None
                    time.sleep(0.2)
            before, peak, done = rss_mb(proc.pid), [0.0], threading.Event()

            def sample() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], rss_mb(proc.pid))
                    time.sleep(0.02)

            text = "word " * int(args.mib * 2**20 / 5)
            body = json.dumps({"model": "seamlessflow-tiny", "messages": [{"role": "user", "content": text}]}).encode()
            results: list = [None] * args.bodies

            def send(i: int) -> None:
                results[i] = post(f"{url}/s/b{i}/v1/chat/completions", body)

            threads = [threading.Thread(target=send, args=(i,)) for i in range(args.bodies)]
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            start = time.perf_counter()
            for t in threads:
                t.start()
            with urllib.request.urlopen(f"{url}/health", timeout=60) as r:
                health = r.status
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            done.set()
            sampler.join()
            after = rss_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(
        f"{args.bodies} bodies of {args.mib:g} MiB at once: statuses {[s for s, _ in results]}, seconds "
        f"{min(t for _, t in results):.2f}-{max(t for _, t in results):.2f} (all in {wall:.2f})"
    )
    print(f"/health during them: {health}")
    print(f"manager resident memory: {before:.0f} MB before, {peak[0]:.0f} MB at the peak, {after:.0f} MB after")
    return 0


if __name__ == "__main__":
    run_benchmark(main)
