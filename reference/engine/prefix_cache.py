"""Prefix caching for the built-in engine: finished requests' keys and values, reused by later requests
that start with the same tokens (an agent's next turn starts with its previous turn).

Entries are whole sequences, not paged blocks: `lookup` finds the entry sharing the longest prefix
with a new prompt and the engine copies that much KV instead of recomputing it. An entry whose
tokens are a prefix of a newer one is dropped (a growing multi-turn session keeps one entry). The
cache holds at most `max_bytes` of KV, evicting the least recently used entry. KV depends on the
weights, so the engine clears the cache on every weight update; a re-prefill after a weight update
(partial rollout) therefore always recomputes.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class _Entry:
    ids: bytes  # the token ids as uint32 bytes, compared with memcmp
    k: torch.Tensor  # [layers, kv_heads, n, head_dim]
    v: torch.Tensor

    @property
    def length(self) -> int:
        return len(self.ids) // 4

    @property
    def nbytes(self) -> int:
        return self.k.nelement() * self.k.element_size() * 2


def _as_bytes(token_ids: Sequence[int]) -> bytes:
    return array("I", token_ids).tobytes()


def common_prefix(a: bytes, b: bytes) -> int:
    """Length in tokens of the common prefix of two uint32 byte strings (binary search over memcmp)."""
    lo, hi = 0, min(len(a), len(b)) // 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    def __init__(self, max_bytes: int, min_match: int = 16) -> None:
        if max_bytes < 0 or min_match < 1:
            raise ValueError(f"max_bytes must be >= 0 and min_match >= 1, got {max_bytes} and {min_match}")
        self.max_bytes, self.min_match = max_bytes, min_match
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.hits = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token_ids: Sequence[int]) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """(n, k, v) for the entry sharing the longest prefix n >= min_match with `token_ids`
        (k, v: [layers, kv_heads, >=n, head_dim], to be sliced to n), or None."""
        if not self._entries:
            return None
        key = _as_bytes(token_ids)
        best, best_n = None, 0
        for entry in self._entries.values():
            n = common_prefix(entry.ids, key)
            if n > best_n:
                best, best_n = entry, n
        if best is None or best_n < self.min_match:
            return None
        self._entries.move_to_end(best.ids)
        self.hits, self.hit_tokens = self.hits + 1, self.hit_tokens + best_n
        return best_n, best.k, best.v

    def put(self, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the KV of `token_ids` (k, v: [layers, kv_heads, len(token_ids), head_dim], owned by the cache)."""
        if len(token_ids) < self.min_match:
            return
        entry = _Entry(_as_bytes(token_ids), k, v)
        if entry.nbytes > self.max_bytes:
            return
        for ids in [ids for ids in self._entries if entry.ids.startswith(ids)]:  # superseded by the new one
            self._drop(ids)
        if entry.ids in self._entries:
            self._drop(entry.ids)
        while self._entries and self.nbytes + entry.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[entry.ids] = entry
        self.nbytes += entry.nbytes

    def _drop(self, ids: bytes) -> None:
        self.nbytes -= self._entries.pop(ids).nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
