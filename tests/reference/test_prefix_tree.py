"""Tests for reference.manager.prefix_tree: whole branches for hand-made sessions (linear, rewrite, resample,
prompt tokens that were generated), errors, and a token-level naive trie as the reference for random
sessions, whose store replay must reproduce `to_json()` exactly."""

from __future__ import annotations

import json
import math
import random
from array import array
from dataclasses import dataclass, field

import pytest

from reference.manager.prefix_tree import Branch, InsertResult, PrefixTree
from reference.manager.store import TrajectoryStore

N = None  # shorthand for a prompt token's logprob / version


def test_linear_session_is_one_node_and_keeps_generated_metadata():
    t = PrefixTree("s")
    assert t.insert([1, 2], [3, 4], [-0.5, -0.25], [0, 0], "a") == InsertResult(0, None, 0)
    # Turn 2's prompt splices turn 1's generated tokens back in: they keep mask 1, logprob and version.
    assert t.insert([1, 2, 3, 4, 5], [6], [-1.0], [1], "b") == InsertResult(4, "a", 0)
    assert t.insert([1, 2, 3, 4, 5, 6, 7, 8], [9, 10], [-2.0, -3.0], [2, 2], "c") == InsertResult(6, "b", 0)
    assert t.branches() == [
        Branch(
            0,
            (1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
            (0, 0, 1, 1, 0, 1, 0, 0, 1, 1),
            (N, N, -0.5, -0.25, N, -1.0, N, N, -2.0, -3.0),
            (N, N, 0, 0, N, 1, N, N, 2, 2),
            ("a", "b", "c"),
        )
    ]
    assert t.to_json()["nodes"] == [{"node_id": 0, "parent": None, "start": 0, "length": 10}]
    assert [t.sequence(r) for r in "abc"] == [(1, 2, 3, 4), (1, 2, 3, 4, 5, 6), tuple(range(1, 11))]


def test_long_linear_session_stays_one_node():
    t, prompt = PrefixTree(), [0]
    for k in range(100):
        t.insert(prompt, [k, k + 1], [-0.1, -0.2], [k, k], f"r{k}")
        prompt = [*prompt, k, k + 1, 7, 7]
    assert len(t.to_json()["nodes"]) == 1
    assert t.sequence("r99") == tuple(prompt[:-2])


def test_history_rewrite_splits_a_node_and_branches():
    t = PrefixTree()
    t.insert([1, 2, 3], [4, 5], [-0.5, -0.5], [0, 0], "a")
    # The agent rewrote its history after token 2: a new branch, the first one untouched.
    assert t.insert([1, 2, 9], [4], [-0.5], [1], "b") == InsertResult(2, "a", 1)
    assert t.branches() == [
        Branch(0, (1, 2, 3, 4, 5), (0, 0, 0, 1, 1), (N, N, N, -0.5, -0.5), (N, N, N, 0, 0), ("a",)),
        Branch(1, (1, 2, 9, 4), (0, 0, 0, 1), (N, N, N, -0.5), (N, N, N, 1), ("b",)),
    ]
    assert t.to_json()["nodes"] == [
        {"node_id": 1, "parent": None, "start": 0, "length": 2},
        {"node_id": 0, "parent": 1, "start": 2, "length": 3},
        {"node_id": 2, "parent": 1, "start": 2, "length": 2},
    ]
    # Extending the old branch still appends in place: no new node.
    assert t.insert([1, 2, 3, 4, 5, 6], [], [], [], "c") == InsertResult(5, "a", 0)
    assert len(t.to_json()["nodes"]) == 3
    assert t.sequence("a") == (1, 2, 3, 4, 5) and t.sequence("c") == (1, 2, 3, 4, 5, 6)


def test_a_tree_holds_no_reference_cycle():
    """A session evicted from memory is freed at once by reference counting: a full garbage collection
    (slow with thousands of sessions in memory) is never needed for it."""
    import gc

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage to be looked at
    try:
        t = PrefixTree("s")
        t.insert([1, 2, 3], [4, 5], [-0.5, -0.5], [0, 0], "a")
        t.insert([1, 2, 9], [4], [-0.5], [1], "b")  # a split and a branch
        t.insert([1, 2, 3, 4, 5, 6], [7], [-0.5], [1], "c")
        assert t.sequence("c") == (1, 2, 3, 4, 5, 6, 7)
        del t
        gc.collect()
        assert not [o for o in gc.garbage if type(o).__module__ == "reference.manager.prefix_tree"]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_same_prompt_sampled_twice():
    t = PrefixTree()
    t.insert([1, 2], [3, 4], [-0.5, -0.5], [0, 0], "a")
    # An identical generation merges: no new branch, both requests end on branch 0.
    assert t.insert([1, 2], [3, 4], [-0.5, -0.5], [0, 0], "same") == InsertResult(2, "a", 0)
    # A prefix of the first generation ends inside its node.
    assert t.insert([1, 2], [3], [-0.5], [0], "prefix") == InsertResult(2, "a", 0)
    # Same ids, one logprob differs: sibling generations from the second token on.
    assert t.insert([1, 2], [3, 4], [-0.5, -0.75], [0, 0], "lp") == InsertResult(2, "a", 1)
    # Same first id but another version: a sibling child of the prompt that starts with the same token id.
    assert t.insert([1, 2], [3], [-0.5], [1], "ver") == InsertResult(2, "a", 2)
    assert [(b.token_ids, b.logprobs, b.versions, b.request_ids) for b in t.branches()] == [
        ((1, 2, 3, 4), (N, N, -0.5, -0.5), (N, N, 0, 0), ("a", "same", "prefix")),
        ((1, 2, 3, 4), (N, N, -0.5, -0.75), (N, N, 0, 0), ("prefix", "lp")),
        ((1, 2, 3), (N, N, -0.5), (N, N, 1), ("ver",)),
    ]
    assert t.to_json()["num_tokens"] == 2 + 1 + 1 + 1 + 1


def test_prompt_match_searches_every_child_with_the_same_token():
    t = PrefixTree()
    t.insert([1], [3, 4], [-1.0, -1.0], [0, 0], "x")  # [1] -> [3, 4]
    t.insert([1], [3], [-2.0], [0], "y")  # sibling [3] (logprob -2)
    t.insert([1], [3, 4, 5], [-2.0, -1.0, -1.0], [0, 0, 0], "y2")  # extends y's leaf in place
    t.insert([1], [3, 8], [-2.0, -1.0], [0, 0], "y3")  # splits it: [3] -> {[4, 5], [8]}
    # The first child [3, 4] matches two tokens and ends; the second [3] matches one, then its child [4, 5]:
    # the longest match goes through the shorter first segment.
    assert t.match_len([1, 3, 4, 5, 7]) == 4
    assert t.insert([1, 3, 4, 5, 7], [], [], [], "z") == InsertResult(4, "y2", 1)
    assert t.branches()[1] == Branch(
        1, (1, 3, 4, 5, 7), (0, 1, 1, 1, 0), (N, -2.0, -1.0, -1.0, N), (N, 0, 0, 0, N), ("y", "y2", "z")
    )


def test_generated_tokens_do_not_merge_with_prompt_tokens():
    t = PrefixTree()
    t.insert([1, 2, 3], [], [], [], "p")  # 3 is a prompt token here
    assert t.insert([1, 2], [3], [-0.5], [0], "g") == InsertResult(2, "p", 1)
    assert [(b.generated_mask, b.request_ids) for b in t.branches()] == [((0, 0, 0), ("p",)), ((0, 0, 1), ("g",))]
    # A later prompt [1, 2, 3, 4] matches both children for 3 tokens: the first (the prompt-token one) wins.
    assert t.insert([1, 2, 3, 4], [], [], [], "q") == InsertResult(3, "p", 0)


def test_inputs_may_be_arrays_or_tuples_and_to_json_is_strict_json():
    t = PrefixTree("sess")
    t.insert(array("I", [5, 6]), array("I", [7]), array("d", [-0.5]), array("i", [3]), "a")
    t.insert((5, 6, 8), (9,), (-1.5,), (4,), "b")
    doc = json.loads(json.dumps(t.to_json(), allow_nan=False))
    assert doc["session_id"] == "sess" and doc["num_branches"] == 2 and doc["num_tokens"] == 5
    assert doc["branches"][1] == {
        "branch_id": 1,
        "token_ids": [5, 6, 8, 9],
        "generated_mask": [0, 0, 0, 1],
        "logprobs": [None, None, None, -1.5],
        "versions": [None, None, None, 4],
        "request_ids": ["b"],
    }
    assert t.request_ids() == ("a", "b") and "a" in t and "zz" not in t


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1], [2], [-0.1], [0], "a"), "already in session"),
        (([1, -2], [2], [-0.1], [0], "n"), "non-negative ints below 2\\*\\*32, got -2"),
        (([1], [2.5], [-0.1], [0], "n"), "got 2.5"),
        (([1], [2, 3], [-0.1], [0], "n"), "differ in length: 2, 1, 1"),
        (([], [2], [-0.1], [0], "n"), "must not be empty"),
        (([1], [2], [math.nan], [0], "n"), "NaN or \\+inf, got nan"),
        (([1], [2], [-0.1], [-1], "n"), "versions must be >= 0, got -1"),
        (([1], [2], [-0.1], [0], ""), "non-empty str"),
        ((b"\x01", [2], [-0.1], [0], "n"), "got bytes"),
    ],
)
def test_insert_rejects_bad_input_and_leaves_the_tree_unchanged(args, message):
    t = PrefixTree("s")
    t.insert([1], [2], [-0.1], [0], "a")
    before = t.to_json()
    with pytest.raises(ValueError, match=message):
        t.insert(*args)
    assert t.to_json() == before


def test_unknown_request_is_a_key_error():
    with pytest.raises(KeyError, match="unknown request_id 'nope'"):
        PrefixTree("s").sequence("nope")


# -- the naive reference: one trie node per token record ----------------------------------------------


@dataclass
class _Tok:
    parent: int
    record: tuple  # (id, mask, logprob | None, version | None)
    children: list[int] = field(default_factory=list)
    branch: int | None = None


class NaiveTree:
    """Token-level trie with the same rules: prompt matched by id (deepest, depth first in creation order),
    generated tokens merged only with identical records, a new branch id whenever a token forks."""

    def __init__(self) -> None:
        self.toks = [_Tok(-1, ())]
        self.ends: dict[str, int] = {}
        self.branches = 0

    def add(self, parent: int, record: tuple) -> int:
        p = self.toks[parent]
        if parent == 0 or p.children:
            branch, self.branches = self.branches, self.branches + 1
        else:
            branch = p.branch
        self.toks.append(_Tok(parent, record, branch=branch))
        p.children.append(len(self.toks) - 1)
        return len(self.toks) - 1

    def match(self, prompt: list[int]) -> tuple[int, int]:
        best, best_depth = 0, 0
        stack = [(0, 0)]
        while stack:
            node, depth = stack.pop()
            if depth > best_depth:
                best, best_depth = node, depth
            if depth < len(prompt):
                kids = [c for c in self.toks[node].children if self.toks[c].record[0] == prompt[depth]]
                stack.extend((c, depth + 1) for c in reversed(kids))
        return best, best_depth

    def insert(self, prompt, ids, logprobs, versions, request_id) -> tuple[int, int]:
        node, depth = self.match(prompt)
        for t in prompt[depth:]:
            node = self.add(node, (t, 0, None, None))
        merging = depth == len(prompt)
        for record in zip(ids, [1] * len(ids), logprobs, versions, strict=True):
            same = [c for c in self.toks[node].children if self.toks[c].record == record] if merging else []
            merging = bool(same)
            node = same[0] if same else self.add(node, record)
        self.ends[request_id] = node
        return depth, self.branch_below(node)

    def branch_below(self, node: int) -> int:
        while self.toks[node].children:
            node = self.toks[node].children[0]
        return self.toks[node].branch

    def path(self, node: int) -> list[int]:
        out = []
        while node:
            out.append(node)
            node = self.toks[node].parent
        return out[::-1]

    def sequence(self, request_id: str) -> tuple[int, ...]:
        return tuple(self.toks[n].record[0] for n in self.path(self.ends[request_id]))

    def branch_list(self) -> list[Branch]:
        leaves = sorted((t.branch, i) for i, t in enumerate(self.toks) if i and not t.children)
        out = []
        for branch, leaf in leaves:
            path = self.path(leaf)
            records = [self.toks[n].record for n in path]
            on_path = set(path)
            request_ids = tuple(r for r, end in self.ends.items() if end in on_path)
            out.append(Branch(branch, *(tuple(column) for column in zip(*records, strict=True)), request_ids))
        return out


def random_requests(rng: random.Random, turns: int):
    """A session's requests: mostly multi-turn continuations, some history rewrites and resamples. A tiny
    vocabulary and few logprob/version values make ids collide and records repeat."""
    done: list[tuple] = []

    def gen(n: int):
        return ([rng.randrange(4) for _ in range(n)], [rng.choice([-0.5, -1.0]) for _ in range(n)], [0] * n)

    for k in range(turns):
        r = rng.random()
        if not done or r < 0.1:
            prompt = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        elif r < 0.65:
            prev = done[-1]
            prompt = prev[0] + prev[1] + [rng.randrange(4) for _ in range(rng.randint(0, 4))]
        elif r < 0.8:
            base = rng.choice(done)
            seq = base[0] + base[1]
            prompt = seq[: rng.randint(0, len(seq))] + [rng.randrange(4) for _ in range(rng.randint(0, 3))]
        else:  # resample an earlier prompt; the engine may reproduce a prefix of its generation
            base = rng.choice(done)
            keep = rng.randint(0, len(base[1]))
            ids, lps, vers = gen(rng.randint(0, 5))
            ids, lps, vers = base[1][:keep] + ids, base[2][:keep] + lps, base[3][:keep] + vers
            done.append((base[0], ids, lps, vers, f"r{k}"))
            continue
        ids, lps, vers = gen(rng.randint(0, 6))
        vers = [rng.choice([0, 1])] * len(ids)
        done.append((prompt or [rng.randrange(4)], ids, lps, vers, f"r{k}"))
    return done


@pytest.mark.parametrize("seed", range(12))
def test_random_sessions_agree_with_the_naive_trie_and_replay_from_the_store(seed):
    rng = random.Random(seed)
    tree, naive, store = PrefixTree(f"s{seed}"), NaiveTree(), TrajectoryStore(":memory:")
    for prompt, ids, lps, vers, rid in random_requests(rng, 60):
        result = tree.insert(prompt, ids, lps, vers, rid)
        match_len, branch = naive.insert(prompt, ids, lps, vers, rid)
        assert (result.match_len, result.branch_id) == (match_len, branch)
        if match_len:
            assert tree.sequence(result.anchor_request_id)[:match_len] == tuple(prompt[:match_len])
        else:
            assert result.anchor_request_id is None
        assert tree.sequence(rid) == tuple(prompt + ids)
        store.append(
            tree.session_id, rid, result.anchor_request_id, match_len, prompt[match_len:], ids, lps, vers, "stop", ""
        )
    assert tree.branches() == naive.branch_list()
    assert all(tree.sequence(r) == naive.sequence(r) for r in naive.ends)
    doc = tree.to_json()
    assert doc["num_tokens"] == len(naive.toks) - 1
    assert sum(n["length"] for n in doc["nodes"]) == doc["num_tokens"]
    assert store.load_tree(tree.session_id).to_json() == doc


@pytest.mark.parametrize("seed", range(6))
def test_an_insert_after_a_plan_matches_as_a_fresh_insert_would(seed):
    """The manager plans each request, then inserts it once stored, with other requests of the session
    planned and inserted in between: an insert that reuses its plan's match (nothing inserted since) and
    one that cannot both agree with the naive trie."""
    rng = random.Random(seed)
    tree, naive = PrefixTree(f"s{seed}"), NaiveTree()
    pending: list[tuple] = []
    requests = random_requests(rng, 80)
    while requests or pending:
        if requests and (not pending or rng.random() < 0.5):
            prompt, ids, lps, vers, rid = requests.pop(0)
            prompt_ids = array("I", prompt)
            planned = tree.plan(prompt_ids)
            pending.append((prompt_ids, ids, lps, vers, rid, planned))
            continue
        prompt_ids, ids, lps, vers, rid, (plan_len, _) = pending.pop(rng.randrange(len(pending)))
        if rng.random() < 0.3:
            tree.plan(prompt_ids)  # planned again just before: the match is reused
        result = tree.insert(prompt_ids, ids, lps, vers, rid)
        match_len, branch = naive.insert(list(prompt_ids), ids, lps, vers, rid)
        assert (result.match_len, result.branch_id) == (match_len, branch)
        assert result.match_len >= plan_len  # the tree only grows: a plan stays a valid anchor
        assert tree.sequence(rid) == tuple(prompt_ids) + tuple(ids)
    assert tree.branches() == naive.branch_list()
