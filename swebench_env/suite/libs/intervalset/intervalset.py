"""Sets of half-open intervals [start, end) over numbers, kept sorted, disjoint and merged."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator
from typing import NamedTuple

__all__ = ["Interval", "IntervalSet"]
__version__ = "1.3.0"


class Interval(NamedTuple):
    start: float
    end: float

    @property
    def length(self) -> float:
        return self.end - self.start

    def overlaps(self, other: Interval) -> bool:
        """Whether the two intervals share at least one point."""
        return self.start < other.end and other.start < self.end

    def touches(self, other: Interval) -> bool:
        """Whether the two intervals overlap or meet end to start, so that their union is one interval."""
        return self.start <= other.end and other.start <= self.end

    def contains(self, point: float) -> bool:
        return self.start <= point < self.end


class IntervalSet:
    """A set of numbers stored as sorted, disjoint, non-touching half-open intervals."""

    def __init__(self, intervals: Iterable[tuple[float, float]] = ()) -> None:
        self._items: list[Interval] = []
        for start, end in intervals:
            self.add(start, end)

    def add(self, start: float, end: float) -> None:
        """Add [start, end), merging it with every interval it overlaps or touches."""
        if start > end:
            raise ValueError(f"interval start {start} is after its end {end}")
        if start == end:
            return
        merged = Interval(start, end)
        kept = []
        for item in self._items:
            if item.touches(merged):
                merged = Interval(min(item.start, merged.start), max(item.end, merged.end))
            else:
                kept.append(item)
        kept.append(merged)
        kept.sort()
        self._items = kept

    def remove(self, start: float, end: float) -> None:
        """Remove [start, end) from the set, splitting intervals that straddle it."""
        if start > end:
            raise ValueError(f"interval start {start} is after its end {end}")
        result = []
        for item in self._items:
            if item.end <= start or item.start >= end:
                result.append(item)
                continue
            if item.start < start:
                result.append(Interval(item.start, start))
            if item.end > end:
                result.append(Interval(end, item.end))
        self._items = result

    def __contains__(self, point: float) -> bool:
        i = bisect_right(self._items, (point, float("inf"))) - 1
        return i >= 0 and point < self._items[i].end

    def __iter__(self) -> Iterator[Interval]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IntervalSet):
            return NotImplemented
        return self._items == other._items

    def __repr__(self) -> str:
        return f"IntervalSet({[tuple(i) for i in self._items]})"

    def total_length(self) -> float:
        return sum(item.length for item in self._items)

    def span(self) -> Interval | None:
        """The smallest interval holding the whole set, or None when the set is empty."""
        if not self._items:
            return None
        return Interval(self._items[0].start, self._items[-1].end)

    def union(self, other: IntervalSet) -> IntervalSet:
        result = IntervalSet(self._items)
        for item in other:
            result.add(*item)
        return result

    __or__ = union

    def intersection(self, other: IntervalSet) -> IntervalSet:
        """The points in both sets, found by walking the two sorted lists together."""
        result = IntervalSet()
        mine, theirs = self._items, other._items
        i = j = 0
        while i < len(mine) and j < len(theirs):
            a, b = mine[i], theirs[j]
            start, end = max(a.start, b.start), min(a.end, b.end)
            if start < end:
                result.add(start, end)
            if a.end < b.end:
                i += 1
            else:
                j += 1
        return result

    __and__ = intersection

    def complement(self, lo: float, hi: float) -> IntervalSet:
        """The points of [lo, hi) that are not in the set."""
        result = IntervalSet([(lo, hi)])
        for item in self._items:
            result.remove(item.start, item.end)
        return result

    def gaps(self) -> list[Interval]:
        """The holes between consecutive intervals, in order."""
        return [Interval(a.end, b.start) for a, b in zip(self._items, self._items[1:])]
