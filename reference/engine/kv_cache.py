"""A slot-based KV cache for the built-in engine: one padded K and V tensor per layer and slot.

K/V have shape [layers, slots, kv_heads, capacity, head_dim]. Running request i lives in slot i (the
engine compacts slots with `move` when one retires). Both the slot and the capacity dimension grow by
doubling, up to `max_slots` and `max_capacity`; there is no paging. Prefixes are reused by copying
from `PrefixCache` (prefix_cache.py), not shared in place.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer and slot: k, v of shape [layers, slots, kv_heads, capacity, head_dim].
    Both the slot and the capacity dimension grow by doubling, up to `max_slots` and `max_capacity`."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, max_slots: int, max_capacity: int, dtype, device="cpu"
    ):
        self.shape = (layers, kv_heads, head_dim)
        self.max_slots, self.max_capacity, self.dtype, self.device = max_slots, max_capacity, dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[3]

    def ensure(self, slots: int, capacity: int) -> None:
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = min(self.max_slots, _grown(self.slots, slots, 4))
        new_capacity = min(self.max_capacity, _grown(self.capacity, capacity, 256))
        layers, kv_heads, head_dim = self.shape
        k = torch.zeros(layers, new_slots, kv_heads, new_capacity, head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        if self.k is not None:
            k[:, : self.slots, :, : self.capacity] = self.k
            v[:, : self.slots, :, : self.capacity] = self.v
        self.k, self.v = k, v

    def move(self, src: int, dst: int, length: int) -> None:
        if self.k is not None and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def release(self) -> None:
        self.k = self.v = None


def _grown(current: int, needed: int, floor: int) -> int:
    size = max(current, floor)
    while size < needed:
        size *= 2
    return size
