"""A least-recently-used cache with statistics, and a memoizing decorator built on it."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["CacheStats", "LRUCache", "memoize"]
__version__ = "1.1.0"

_MISSING = object()


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    size: int
    capacity: int

    @property
    def hit_rate(self) -> float:
        """Hits per lookup; 0.0 before the first lookup."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class LRUCache:
    """At most `capacity` entries; adding one more evicts the least recently used."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for `key` (which becomes the most recently used), or `default`."""
        if key in self._data:
            self._data.move_to_end(key)
            self.hits += 1
            return self._data[key]
        self.misses += 1
        return default

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The value for `key` without touching recency or statistics."""
        return self._data.get(key, default)

    def put(self, key: Hashable, value: Any) -> None:
        """Store `value` under `key` as the most recently used entry, evicting if over capacity."""
        if key in self._data:
            self._data.move_to_end(key)
        self._data[key] = value
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)

    def pop(self, key: Hashable, default: Any = _MISSING) -> Any:
        if default is _MISSING:
            return self._data.pop(key)
        return self._data.pop(key, default)

    def resize(self, capacity: int) -> None:
        """Change the capacity, evicting the least recently used entries that no longer fit."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        while len(self._data) > capacity:
            self._data.popitem(last=False)

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        return list(self._data)

    def clear(self) -> None:
        self._data.clear()
        self.hits = self.misses = 0

    def stats(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, len(self._data), self.capacity)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)


def memoize(maxsize: int = 128) -> Callable[[Callable], Callable]:
    """Cache a function's results by its arguments (positional and keyword) in an LRUCache."""

    def decorate(func: Callable) -> Callable:
        cache = LRUCache(maxsize)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            key = args
            if kwargs:
                key += (_MISSING, *sorted(kwargs.items()))
            value = cache.get(key, _MISSING)
            if value is _MISSING:
                value = func(*args, **kwargs)
                cache.put(key, value)
            return value

        wrapper.cache = cache
        wrapper.cache_clear = cache.clear
        return wrapper

    return decorate
