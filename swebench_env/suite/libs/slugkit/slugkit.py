"""URL slugs from arbitrary text."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

__all__ = ["UniqueSlugger", "slugify"]
__version__ = "1.0.4"

_NOT_WORD = re.compile(r"[^A-Za-z0-9]+")
_SPECIAL = {"ß": "ss", "æ": "ae", "Æ": "AE", "ø": "o", "Ø": "O", "œ": "oe", "Œ": "OE", "&": " and "}


def ascii_fold(text: str) -> str:
    """`text` with accents removed and a few letters spelled out in ASCII; other characters dropped."""
    for char, spelled in _SPECIAL.items():
        text = text.replace(char, spelled)
    decomposed = unicodedata.normalize("NFKD", text)
    return decomposed.encode("ascii", "ignore").decode("ascii")


def _truncate(words: list[str], separator: str, max_length: int) -> list[str]:
    """The longest prefix of `words` whose joined length is at most `max_length` (at least one word, cut)."""
    kept: list[str] = []
    length = 0
    for word in words:
        added = len(word) + (len(separator) if kept else 0)
        if length + added > max_length:
            break
        kept.append(word)
        length += added
    if not kept and words:
        kept = [words[0][:max_length]]
    return kept


def slugify(
    text: str,
    separator: str = "-",
    *,
    lowercase: bool = True,
    max_length: int | None = None,
    stopwords: Iterable[str] = (),
) -> str:
    """A slug of `text`: ASCII letters and digits, words joined by `separator`.

    Stop words are compared case-insensitively and dropped unless that would leave nothing.
    With `max_length`, whole words are dropped from the end until the slug fits.
    """
    words = [w for w in _NOT_WORD.split(ascii_fold(text)) if w]
    if lowercase:
        words = [w.lower() for w in words]
    stops = {s.lower() for s in stopwords}
    kept = [w for w in words if w.lower() not in stops]
    if kept:
        words = kept
    if max_length is not None:
        if max_length < 1:
            raise ValueError(f"max_length must be at least 1, got {max_length}")
        words = _truncate(words, separator, max_length)
    return separator.join(words)


class UniqueSlugger:
    """Slugs that are unique among those it has made: repeats get "-2", "-3", ... appended."""

    def __init__(self, separator: str = "-", **options) -> None:
        self.separator = separator
        self.options = options
        self._seen: set[str] = set()

    def slug(self, text: str) -> str:
        base = slugify(text, self.separator, **self.options) or "item"
        candidate = base
        n = 2
        while candidate in self._seen:
            candidate = f"{base}{self.separator}{n}"
            n += 1
        self._seen.add(candidate)
        return candidate
