"""Inclusive ranges of calendar dates."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import date, timedelta

__all__ = ["DateRange", "month_range", "parse_range"]
__version__ = "0.9.2"

ONE_DAY = timedelta(days=1)


@dataclass(frozen=True)
class DateRange:
    """The dates from `start` to `end`, both included."""

    start: date
    end: date

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"range ends ({self.end}) before it starts ({self.start})")

    def __len__(self) -> int:
        return (self.end - self.start).days + 1

    def __contains__(self, day: date) -> bool:
        return self.start <= day <= self.end

    def __iter__(self) -> Iterator[date]:
        day = self.start
        while day <= self.end:
            yield day
            day += ONE_DAY

    def __str__(self) -> str:
        return f"{self.start.isoformat()}..{self.end.isoformat()}"

    def overlaps(self, other: DateRange) -> bool:
        """Whether the two ranges share at least one day."""
        return self.start <= other.end and other.start <= self.end

    def intersection(self, other: DateRange) -> DateRange | None:
        """The days in both ranges, or None if they share none."""
        if not self.overlaps(other):
            return None
        return DateRange(max(self.start, other.start), min(self.end, other.end))

    def shift(self, days: int) -> DateRange:
        return DateRange(self.start + timedelta(days=days), self.end + timedelta(days=days))

    def split_by_month(self) -> list[DateRange]:
        """The range cut at month boundaries, in order."""
        parts = []
        start = self.start
        while start <= self.end:
            end = min(month_range(start.year, start.month).end, self.end)
            parts.append(DateRange(start, end))
            start = end + ONE_DAY
        return parts

    def weeks(self, first_weekday: int = 0) -> list[DateRange]:
        """The range cut before every `first_weekday` (0 = Monday ... 6 = Sunday)."""
        parts = []
        start = self.start
        for day in self:
            if day.weekday() == first_weekday and day != start:
                parts.append(DateRange(start, day - ONE_DAY))
                start = day
        parts.append(DateRange(start, self.end))
        return parts

    def business_days(self, holidays: Iterable[date] = ()) -> int:
        """The number of days from Monday to Friday in the range that are not `holidays`."""
        closed = set(holidays)
        return sum(1 for day in self if day.weekday() < 5 and day not in closed)


def month_range(year: int, month: int) -> DateRange:
    """The whole calendar month."""
    if not 1 <= month <= 12:
        raise ValueError(f"month must be 1 to 12, got {month}")
    first = date(year, month, 1)
    if month == 12:
        following = date(year + 1, 1, 1)
    else:
        following = date(year, month + 1, 1)
    return DateRange(first, following - ONE_DAY)


def parse_range(text: str, separator: str = "..") -> DateRange:
    """A range written as "2024-01-01..2024-01-31"; a single date is a one-day range."""
    if separator not in text:
        day = date.fromisoformat(text.strip())
        return DateRange(day, day)
    start, _, end = text.partition(separator)
    return DateRange(date.fromisoformat(start.strip()), date.fromisoformat(end.strip()))
