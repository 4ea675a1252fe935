"""Does appending a turn to a session cost the same with 100k tokens of history as with 1k?

Times `PrefixTree.insert` of one turn (200 new prompt tokens + 300 generated) after 1k and 100k tokens of
history, with the prompt passed as array('I') (the tree's own cost: a memcmp over the history plus work
on the new tokens) and as a list (adds converting every prompt id, an O(history) C loop). Each repetition
starts from a fresh tree holding the history as one linear branch (one node, as a real linear session
is). Then `TrajectoryStore.append` of the same turn to an on-disk store (WAL), and `load_tree` replay of
a 100-turn session. Runs in well under 30 s.

    python -m benchmarks.prefix_tree [--reps 1000]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path

from core.cli import at_least
from reference.manager.prefix_tree import PrefixTree
from reference.manager.store import TrajectoryStore

NEW_PROMPT, GENERATED = 200, 300


def turn(rng: random.Random, n_prompt: int, n_gen: int) -> tuple[list[int], list[int], list[float], list[int]]:
    """Random prompt ids and a generation (ids, logprobs, versions), as the manager holds them: lists."""
    ids = [rng.randrange(150_000) for _ in range(n_prompt + n_gen)]
    return ids[:n_prompt], ids[n_prompt:], [-rng.random() for _ in range(n_gen)], [1] * n_gen


def summary(samples_us: list[float]) -> tuple[float, float]:
    """(median, p99) in microseconds."""
    ordered = sorted(samples_us)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def timed(reps: int, setup: Callable[[], object], run: Callable[[object], object]) -> list[float]:
    """Microseconds of run(setup()) per repetition; the collector runs only between timings."""
    samples = []
    gc.disable()
    try:
        for i in range(reps):
            state = setup()
            start = time.perf_counter_ns()
            run(state)
            samples.append((time.perf_counter_ns() - start) / 1e3)
            if i % 100 == 99:
                gc.collect()
    finally:
        gc.enable()
    return samples


def tree_append(history: int, reps: int, as_list: bool, rng: random.Random) -> list[float]:
    """Insert one turn into a fresh tree holding `history` tokens of one linear session."""
    prompt, ids, lps, vers = turn(rng, history - GENERATED, GENERATED)
    history_prompt, history_gen = array("I", prompt), array("I", ids)
    new_prompt, new_ids, new_lps, new_vers = turn(rng, NEW_PROMPT, GENERATED)
    next_prompt = history_prompt + history_gen + array("I", new_prompt)
    prompt_arg = next_prompt.tolist() if as_list else next_prompt

    def setup() -> PrefixTree:
        tree = PrefixTree("bench")
        tree.insert(history_prompt, history_gen, lps, vers, "history")
        return tree

    return timed(reps, setup, lambda tree: tree.insert(prompt_arg, new_ids, new_lps, new_vers, "next"))


def store_append(store: TrajectoryStore, session: str, history: int, reps: int, rng: random.Random) -> list[float]:
    """Append `reps` turns to a session that starts with `history` tokens (it grows by 500 per turn)."""
    length, n = 0, 0
    while length < history:
        prompt, ids, lps, vers = turn(rng, NEW_PROMPT, GENERATED)
        store.append(session, f"h{n}", f"h{n - 1}" if n else None, length, prompt, ids, lps, vers, "stop", "t")
        length, n = length + NEW_PROMPT + GENERATED, n + 1
    prompt, ids, lps, vers = turn(rng, NEW_PROMPT, GENERATED)
    count = iter(range(reps))

    def run(_: object) -> None:
        i = next(count)
        store.append(session, f"t{i}", f"h{n - 1}", length, prompt, ids, lps, vers, "stop", "text " * 60)

    return timed(reps, lambda: None, run)


def replay(store: TrajectoryStore, turns: int, reps: int, rng: random.Random) -> list[float]:
    """load_tree of a linear session of `turns` turns of 200 prompt + 300 generated tokens."""
    tree = PrefixTree("replay")
    prompt: list[int] = []
    for k in range(turns):
        new_prompt, ids, lps, vers = turn(rng, NEW_PROMPT, GENERATED)
        prompt = prompt + new_prompt
        r = tree.insert(prompt, ids, lps, vers, f"r{k}")
        store.append(
            "replay", f"r{k}", r.anchor_request_id, r.match_len, prompt[r.match_len :], ids, lps, vers, "stop", ""
        )
        prompt = prompt + ids
    assert store.load_tree("replay").to_json() == tree.to_json()
    return timed(reps, lambda: None, lambda _: store.load_tree("replay"))


def report(label: str, small: list[float], large: list[float]) -> None:
    (m1, p1), (m2, p2) = summary(small), summary(large)
    print(f"  {label:<28} {m1:9.1f} {p1:9.1f} {m2:9.1f} {p2:9.1f} {m2 / m1:12.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=at_least(3), default=1000, help="repetitions per tree case (store: a third)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)

    print(f"one turn (+{NEW_PROMPT} prompt, +{GENERATED} generated tokens) after 1k vs 100k tokens of history")
    print(f"  {'microseconds':<28} {'1k med':>9} {'1k p99':>9} {'100k med':>9} {'100k p99':>9} {'ratio (med)':>12}")
    for as_list in (False, True):
        small, large = (tree_append(h, args.reps, as_list, rng) for h in (1_000, 100_000))
        report(f"tree.insert, prompt {'list' if as_list else 'array'}", small, large)
    with tempfile.TemporaryDirectory() as tmp, TrajectoryStore(Path(tmp) / "bench.db") as store:
        small = store_append(store, "small", 1_000, args.reps // 3, rng)
        large = store_append(store, "large", 100_000, args.reps // 3, rng)
        report("store.append (WAL, on disk)", small, large)
        median, p99 = summary(replay(store, 100, 20, rng))
        print(f"load_tree of a 100-turn session (50k tokens): median {median / 1e3:.1f} ms, p99 {p99 / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
