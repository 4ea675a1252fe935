"""Descriptive statistics for sequences of numbers."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

__all__ = ["histogram", "mean", "median", "mode", "moving_average", "percentile", "stdev", "variance", "zscores"]
__version__ = "0.6.0"


def _require(data: Sequence[float], n: int, what: str) -> None:
    if len(data) < n:
        raise ValueError(f"{what} needs at least {n} value{'s' if n > 1 else ''}, got {len(data)}")


def mean(data: Sequence[float]) -> float:
    _require(data, 1, "mean")
    return sum(data) / len(data)


def median(data: Sequence[float]) -> float:
    """The middle value; for an even count, the mean of the two middle values."""
    _require(data, 1, "median")
    ordered = sorted(data)
    mid = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return float(ordered[mid])
    return (ordered[mid - 1] + ordered[mid]) / 2


def mode(data: Sequence[float]) -> float:
    """The most common value; ties go to the smallest."""
    _require(data, 1, "mode")
    counts = Counter(data)
    best = max(counts.values())
    return min(value for value, count in counts.items() if count == best)


def percentile(data: Sequence[float], p: float) -> float:
    """The p-th percentile (0 to 100) by linear interpolation between the closest ranks."""
    _require(data, 1, "percentile")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be between 0 and 100, got {p}")
    ordered = sorted(data)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def variance(data: Sequence[float], population: bool = False) -> float:
    """The sample variance (divided by n - 1), or the population variance (divided by n)."""
    _require(data, 1 if population else 2, "variance")
    centre = mean(data)
    squares = sum((x - centre) ** 2 for x in data)
    return squares / (len(data) if population else len(data) - 1)


def stdev(data: Sequence[float], population: bool = False) -> float:
    return math.sqrt(variance(data, population))


def zscores(data: Sequence[float]) -> list[float]:
    """How many sample standard deviations each value lies from the mean."""
    centre, spread = mean(data), stdev(data)
    if spread == 0:
        raise ValueError("z-scores are undefined when all values are equal")
    return [(x - centre) / spread for x in data]


def moving_average(data: Sequence[float], window: int) -> list[float]:
    """The mean of every run of `window` consecutive values, in order."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    return [sum(data[i : i + window]) / window for i in range(len(data) - window + 1)]


def histogram(data: Sequence[float], bins: int, lo: float, hi: float) -> list[int]:
    """Counts of values in `bins` equal-width bins over [lo, hi]; `hi` itself goes in the last bin."""
    if bins < 1 or hi <= lo:
        raise ValueError("need at least one bin and lo < hi")
    counts = [0] * bins
    width = (hi - lo) / bins
    for x in data:
        if lo <= x <= hi:
            counts[min(int((x - lo) / width), bins - 1)] += 1
    return counts
