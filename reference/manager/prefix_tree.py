"""One session's trajectory tree: a radix tree over token ids that merges the session's requests.

The trajectory manager inserts every finished request here. In the usual multi-turn case turn k+1's
prompt starts with turn k's prompt + generated tokens, so the session stays one linear branch (one node,
extended in place) in which generated tokens carry their engine logprob and policy version (mask 1) and
prompt, tool and user tokens do not (mask 0). Prompt tokens are matched by token id only, so a prompt
token that an earlier turn generated keeps its generated metadata. Generated tokens merge only with
identical records (same id, mask 1, same logprob, same version): a history rewrite or a second sample of
the same prompt becomes a new branch, never a corrupted sequence. Since a node may therefore have several
children starting with the same token id, prompt matching searches all of them (depth first, children in
creation order) for the longest match; ties go to the first found.

Cost: an insert does Python work in proportion to the new tokens. The history is compared a whole segment
at a time, never token by token: token ids and masks are kept as bytearrays (native uint32 and uint8)
because `bytearray.startswith(view, offset)` is a memcmp of two buffers in place, whereas `array.__eq__`
loops item by item and slicing an array copies. A divergence inside a segment is found by a binary search
over such compares, whose sizes halve. Logprobs (float64, NaN for prompt tokens) and versions (int32, -1
for prompt tokens) stay `array`s; they are only compared over generated tokens. Only a split (a rewrite or
a resample diverging inside a node) copies a node's data, once, at memcpy speed. A prompt passed as
array('I') is used without conversion; a list or tuple costs one C loop over its ids.

Not thread-safe: the manager touches a session's tree from its event loop only.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

assert array("I").itemsize == 4 and array("i").itemsize == 4 and array("d").itemsize == 8
_ONE = b"\x01"


@dataclass(frozen=True)
class InsertResult:
    """Where a request landed: enough, with prompt[match_len:], to replay the insert (see `store`).

    match_len: length of the longest prefix of the prompt already in the tree (matched by token id).
    anchor_request_id: an earlier request whose full sequence starts with prompt[:match_len]; None when
        match_len == 0.
    branch_id: a branch that holds the request's last token (the first-created one when several do).
    """

    match_len: int
    anchor_request_id: str | None
    branch_id: int


@dataclass(frozen=True)
class Branch:
    """One root-to-leaf path. logprobs and versions are None for prompt tokens (mask 0); request_ids are
    the requests whose full sequence ends on this path, in insertion order."""

    branch_id: int
    token_ids: tuple[int, ...]
    generated_mask: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    versions: tuple[int | None, ...]
    request_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "branch_id": self.branch_id,
            "token_ids": list(self.token_ids),
            "generated_mask": list(self.generated_mask),
            "logprobs": list(self.logprobs),
            "versions": list(self.versions),
            "request_ids": list(self.request_ids),
        }


class _Node:
    """A segment of tokens: ids (native uint32 bytes), mask (0/1 bytes), logprobs, versions. `cover` is a
    request whose full sequence contains every token of the node: the anchor for a match that ends here.
    The parent is named by its node id (-1: the root), not referenced: a tree holds no reference cycle, so
    it is freed the moment its session leaves memory, without waiting for a full garbage collection."""

    __slots__ = (
        "node_id",
        "parent_id",
        "start",
        "ids",
        "mask",
        "logprobs",
        "versions",
        "children",
        "branch_id",
        "cover",
    )

    def __init__(self, node_id: int, parent_id: int, start: int, segment: _Segment, cover: str) -> None:
        self.node_id, self.parent_id, self.start, self.cover = node_id, parent_id, start, cover
        self.ids, self.mask, self.logprobs, self.versions = segment
        self.children: dict[int, list[_Node]] = {}  # first token id -> children, in creation order
        self.branch_id: int | None = None  # set on leaves only

    def __len__(self) -> int:
        return len(self.mask)

    @property
    def end(self) -> int:
        return self.start + len(self.mask)

    def first_token(self) -> int:
        return int.from_bytes(self.ids[:4], sys.byteorder)


_Segment = tuple[bytearray, bytearray, array, array]  # ids, mask, logprobs, versions


@dataclass(frozen=True)
class _Turn:
    """A validated request: prompt and generated ids as array('I'), logprobs array('d'), versions array('i')."""

    prompt: array
    token_ids: array
    logprobs: array
    versions: array


def _common_prefix(n: int, same: Callable[[int, int], bool]) -> int:
    """Largest k <= n such that items [0, k) agree, where same(i, j) tells whether items [i, j) agree:
    one compare of the whole range, then a binary search whose compares halve (O(n) work in all)."""
    if n <= 0 or same(0, n):
        return max(n, 0)
    lo, hi = 0, n  # [0, lo) agrees, [0, hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if same(lo, mid):
            lo = mid
        else:
            hi = mid
    return lo


def _ids_prefix(ids: bytearray, at: int, view: memoryview, start: int, n: int) -> int:
    """Common prefix (in tokens) of ids[at:at + n] and tokens [start, start + n) of `view`, a byte view of
    uint32 ids; memcmp compares, no copies."""
    return _common_prefix(n, lambda i, j: ids.startswith(view[4 * (start + i) : 4 * (start + j)], 4 * (at + i)))


def _record_prefix(node: _Node, at: int, turn: _Turn, view: memoryview, start: int) -> int:
    """How many generated tokens from `start` are identical records (id, mask 1, logprob, version) to the
    node's tokens from `at`."""
    k = _ids_prefix(node.ids, at, view, start, min(len(node) - at, len(turn.token_ids) - start))
    zero = node.mask.find(0, at, at + k)
    k = k if zero < 0 else zero - at
    lps, vers = node.logprobs, node.versions
    # memoryview compares float64 items in C (array.__eq__ on 'd' boxes every item).
    k = _common_prefix(
        k, lambda i, j: memoryview(lps)[at + i : at + j] == memoryview(turn.logprobs)[start + i : start + j]
    )
    return _common_prefix(k, lambda i, j: vers[at + i : at + j] == turn.versions[start + i : start + j])


def _as_ids(name: str, values: Sequence[int]) -> array:
    if isinstance(values, array) and values.typecode == "I":
        return values
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    items, out = values if isinstance(values, list) else list(values), array("I")
    try:
        out.fromlist(items)  # the fastest conversion from Python ints
        return out
    except (TypeError, OverflowError):
        bad = next((v for v in items if not isinstance(v, int) or not 0 <= v < 2**32), None)
        raise ValueError(f"{name} must be non-negative ints below 2**32, got {bad!r}") from None


def _validated(
    prompt: Sequence[int], token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
) -> _Turn:
    p, g = _as_ids("prompt_token_ids", prompt), _as_ids("token_ids", token_ids)
    if not p:
        raise ValueError("prompt_token_ids must not be empty")
    if not len(g) == len(logprobs) == len(versions):
        raise ValueError(
            f"token_ids, logprobs and versions differ in length: {len(g)}, {len(logprobs)}, {len(versions)}"
        )
    try:
        lp, v = array("d", logprobs), array("i", versions)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"logprobs must be floats and versions ints: {e}") from None
    total = sum(lp)  # NaN iff some logprob is NaN or both +inf and -inf occur; +inf iff some is +inf
    if math.isnan(total) or total == math.inf:
        bad = next(x for x in lp if math.isnan(x) or x == math.inf)
        raise ValueError(f"logprobs must not be NaN or +inf, got {bad}")
    if v and min(v) < 0:
        raise ValueError(f"versions must be >= 0, got {min(v)}")
    return _Turn(p, g, lp, v)


def _segment(prompt_view: memoryview, turn: _Turn, gen_view: memoryview, gen_start: int) -> _Segment:
    """New tokens: the prompt tokens in `prompt_view` (mask 0), then generated tokens from `gen_start`."""
    n_prompt = len(prompt_view) // 4
    ids = bytearray(prompt_view)
    ids += gen_view[4 * gen_start :]
    mask = bytearray(n_prompt)
    mask += _ONE * (len(turn.token_ids) - gen_start)
    logprobs = array("d", [math.nan]) * n_prompt
    logprobs += turn.logprobs[gen_start:]
    versions = array("i", [-1]) * n_prompt
    versions += turn.versions[gen_start:]
    return ids, mask, logprobs, versions


class PrefixTree:
    """A session's requests merged into one trajectory tree; see the module docstring."""

    def __init__(self, session_id: str = "") -> None:
        self.session_id = session_id
        self._root = _Node(-1, -1, 0, (bytearray(), bytearray(), array("d"), array("i")), "")
        self._nodes: list[_Node] = []  # creation order; node_id is the index
        self._leaves: dict[int, _Node] = {}  # branch_id -> leaf, in creation order
        # request id -> (a node at or below the one holding its last token, sequence length). Splits only
        # insert nodes above, so the holder is found by walking up (see _locate).
        self._requests: dict[str, tuple[_Node, int]] = {}
        self.num_tokens = 0  # tokens held (each stored once, however many requests share it)
        # the last `plan` since the last insert (every insert forgets it): (prompt, its length, node, off)
        self._planned: tuple[array, int, _Node, int] | None = None

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def request_ids(self) -> tuple[str, ...]:
        """Every request in the tree, in insertion order."""
        return tuple(self._requests)

    def insert(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        request_id: str,
    ) -> InsertResult:
        """Merge a finished request (its prompt, then its generated tokens with their logprobs and policy
        versions) into the tree. The tree is unchanged if this raises."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in session {self.session_id!r}")
        turn = _validated(prompt_token_ids, token_ids, logprobs, versions)
        prompt_view, gen_view = memoryview(turn.prompt).cast("B"), memoryview(turn.token_ids).cast("B")
        planned, self._planned = self._planned, None
        try:
            if planned and planned[0] is turn.prompt and planned[1] == len(turn.prompt):
                node, off = planned[2], planned[3]  # `plan` matched this very prompt, and nothing changed since
            else:
                node, off = self._match(turn.prompt, prompt_view)
            match_len = node.start + off
            anchor = node.cover if match_len else None
            gen_start = 0
            if match_len == len(turn.prompt):
                node, off, gen_start = self._merge_generated(node, off, turn, gen_view)
            if match_len < len(turn.prompt) or gen_start < len(turn.token_ids):
                segment = _segment(prompt_view[4 * match_len :], turn, gen_view, gen_start)
                node, off = self._attach(node, off, segment, request_id)
        finally:
            prompt_view.release()
            gen_view.release()
        self._requests[request_id] = (node, node.start + off)
        return InsertResult(match_len, anchor, self._branch_below(node))

    def match_len(self, token_ids: Sequence[int]) -> int:
        """Length of the longest prefix of `token_ids` present in the tree (by token id)."""
        return self.plan(token_ids)[0]

    def plan(self, token_ids: Sequence[int]) -> tuple[int, str | None]:
        """(match_len, anchor_request_id) that `insert` would report for this prompt now, without changing
        the tree. The manager stores a request under its plan before inserting it; inserts made in
        between can only lengthen the match (the tree never shrinks), so the plan stays a valid anchor.
        An `insert` of the same array('I') object (unchanged) with no insert in between reuses this match."""
        ids = _as_ids("token_ids", token_ids)
        if not ids:
            return 0, None
        view = memoryview(ids).cast("B")
        try:
            node, off = self._match(ids, view)
        finally:
            view.release()
        self._planned = (ids, len(ids), node, off)
        match_len = node.start + off
        return match_len, (node.cover if match_len else None)

    def planned_generated_prefix(self) -> int:
        """Of the prompt the last `plan` matched, the longest matched prefix that is a whole history: it ends where
        a stored sequence ends after a reply, or where a run of generated tokens is followed by prompt tokens
        (0 if there is none). That is what an agent's next turn finds cached. Reported instead of the whole
        match, so that someone who knows a session's id cannot read its prompts or replies a token at a time by
        probing which guesses come back cached: a guess counts only once it holds everything up to a reply's end."""
        if self._planned is None:
            return 0
        _, _, node, off = self._planned
        if node is not self._root and off == len(node) and not node.children and node.mask and node.mask[-1] == 1:
            return node.end  # a stored sequence ends here, with a reply
        after = None  # the mask of the matched token after this node's part of the match (None: none matched)
        while node is not self._root:
            seg = node.mask[:off]
            if seg and seg[-1] == 1 and after == 0:
                return node.start + off
            last = seg.rfind(b"\x01\x00")
            if last >= 0:
                return node.start + last + 1
            after = seg[0] if seg else after
            node = self._parent(node)
            off = len(node)
        return 0

    def sequence(self, request_id: str) -> tuple[int, ...]:
        """A request's full token sequence: prompt + generated. O(length)."""
        return tuple(self.sequence_array(request_id))

    def sequence_array(self, request_id: str) -> array:
        """`sequence` as a fresh array('I') (what replay uses: no boxing of every id)."""
        node, depth = self._locate(request_id)
        ids = bytearray().join(n.ids for n in self._path(node))
        out = array("I")
        out.frombytes(memoryview(ids)[: 4 * depth])
        return out

    def branches(self) -> list[Branch]:
        """One branch per leaf, root to leaf, in branch id (creation) order."""
        ends: dict[int, list[tuple[int, str]]] = {}
        for order, request_id in enumerate(self._requests):
            ends.setdefault(self._locate(request_id)[0].node_id, []).append((order, request_id))
        out = []
        for branch_id, leaf in self._leaves.items():
            path = self._path(leaf)
            requests = sorted(end for n in path for end in ends.get(n.node_id, ()))
            out.append(_make_branch(branch_id, path, tuple(r for _, r in requests)))
        return out

    def to_json(self) -> dict[str, Any]:
        """The whole tree as JSON-serialisable data: branches, and the node structure."""
        branches = self.branches()
        return {
            "session_id": self.session_id,
            "num_branches": len(branches),
            "num_tokens": self.num_tokens,
            "branches": [b.to_json() for b in branches],
            "nodes": [  # parents before children
                {
                    "node_id": n.node_id,
                    "parent": None if n.parent_id < 0 else n.parent_id,
                    "start": n.start,
                    "length": len(n),
                }
                for n in self._preorder()
            ],
        }

    # -- matching -------------------------------------------------------------------------------------

    def _match(self, prompt: array, view: memoryview) -> tuple[_Node, int]:
        """The deepest point (node, offset) whose root path equals a prefix of `prompt` by token id.
        Depth first over every child that starts with the next token, in creation order."""
        best, best_off, best_depth = self._root, 0, 0
        stack = list(reversed(self._root.children.get(prompt[0], ())))
        while stack:
            node = stack.pop()
            k = _ids_prefix(node.ids, 0, view, node.start, min(len(node), len(prompt) - node.start))
            if node.start + k > best_depth:
                best, best_off, best_depth = node, k, node.start + k
            if k == len(node) and node.end < len(prompt):
                stack.extend(reversed(node.children.get(prompt[node.end], ())))
        return best, best_off

    def _merge_generated(self, node: _Node, off: int, turn: _Turn, view: memoryview) -> tuple[_Node, int, int]:
        """Follow the generated tokens along identical existing records from (node, off); returns the point
        reached and how many generated tokens were merged."""
        gen, done = turn.token_ids, 0
        while done < len(gen):
            if off == len(node):
                child = next((c for c in node.children.get(gen[done], ()) if _same_first(c, turn, done)), None)
                if child is None:
                    break
                node, off = child, 0
            k = _record_prefix(node, off, turn, view, done)
            off, done = off + k, done + k
            if k == 0 or off < len(node):
                break
        return node, off, done

    # -- growing --------------------------------------------------------------------------------------

    def _attach(self, node: _Node, off: int, segment: _Segment, request_id: str) -> tuple[_Node, int]:
        """Add new tokens after (node, off): in place at the end of a leaf, else as a new leaf (splitting
        the node first when off falls inside it). Returns the end point."""
        self.num_tokens += len(segment[1])
        if node is not self._root and off == len(node) and not node.children:
            ids, mask, logprobs, versions = segment
            node.ids += ids
            node.mask += mask
            node.logprobs += logprobs
            node.versions += versions
            node.cover = request_id
            return node, len(node)
        if off < len(node):
            node = self._split(node, off)
        leaf = self._new_node(node.node_id, node.end, segment, request_id)
        node.children.setdefault(leaf.first_token(), []).append(leaf)
        leaf.branch_id = len(self._leaves)
        self._leaves[leaf.branch_id] = leaf
        return leaf, len(leaf)

    def _split(self, node: _Node, off: int) -> _Node:
        """Cut `node` at `off`: a new head node takes its first `off` tokens and its place under the parent;
        `node` keeps the rest, its children, node id and branch id (so recorded request ends stay below)."""
        head_segment = (node.ids[: 4 * off], node.mask[:off], node.logprobs[:off], node.versions[:off])
        head = self._new_node(node.parent_id, node.start, head_segment, node.cover)
        siblings = self._parent(node).children[node.first_token()]
        siblings[siblings.index(node)] = head
        del node.ids[: 4 * off], node.mask[:off], node.logprobs[:off], node.versions[:off]
        node.start += off
        node.parent_id = head.node_id
        head.children[node.first_token()] = [node]
        return head

    def _new_node(self, parent_id: int, start: int, segment: _Segment, cover: str) -> _Node:
        node = _Node(len(self._nodes), parent_id, start, segment, cover)
        self._nodes.append(node)
        return node

    # -- reading --------------------------------------------------------------------------------------

    def _locate(self, request_id: str) -> tuple[_Node, int]:
        """(node holding the request's last token, sequence length)."""
        if request_id not in self._requests:
            raise KeyError(f"unknown request_id {request_id!r} in session {self.session_id!r}")
        node, depth = self._requests[request_id]
        while node.start >= depth:
            node = self._parent(node)
        self._requests[request_id] = (node, depth)
        return node, depth

    def _path(self, node: _Node) -> list[_Node]:
        """Nodes from the root's child down to `node`."""
        path = []
        while node is not self._root:
            path.append(node)
            node = self._parent(node)
        return path[::-1]

    def _parent(self, node: _Node) -> _Node:
        return self._root if node.parent_id < 0 else self._nodes[node.parent_id]

    def _preorder(self) -> list[_Node]:
        """Every node but the root, depth first (parents before children)."""
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed([c for group in node.children.values() for c in group]))
        return out[1:]

    @staticmethod
    def _branch_below(node: _Node) -> int:
        """The branch id of the first-created leaf at or below `node`."""
        while node.branch_id is None:
            node = next(iter(node.children.values()))[0]
        return node.branch_id


def _same_first(node: _Node, turn: _Turn, i: int) -> bool:
    """Whether the node's first token is the generated record i of `turn` (its id already matches)."""
    return node.mask[0] == 1 and node.logprobs[0] == turn.logprobs[i] and node.versions[0] == turn.versions[i]


def _make_branch(branch_id: int, path: list[_Node], request_ids: tuple[str, ...]) -> Branch:
    ids = array("I")
    ids.frombytes(bytearray().join(n.ids for n in path))
    mask = bytearray().join(n.mask for n in path)
    logprobs, versions = array("d"), array("i")
    for n in path:
        logprobs += n.logprobs
        versions += n.versions
    return Branch(
        branch_id,
        tuple(ids),
        tuple(mask),
        tuple(lp if m else None for lp, m in zip(logprobs, mask, strict=True)),
        tuple(v if m else None for v, m in zip(versions, mask, strict=True)),
        request_ids,
    )
