"""Greedy word wrapping, justification, shortening and dedenting of plain text."""

from __future__ import annotations

__all__ = ["dedent", "fill", "justify", "shorten", "wrap"]
__version__ = "2.1.0"


def _chunks(word: str, size: int) -> list[str]:
    return [word[i : i + size] for i in range(0, len(word), size)]


def wrap(
    text: str,
    width: int = 70,
    *,
    indent: str = "",
    subsequent_indent: str | None = None,
    break_long_words: bool = True,
) -> list[str]:
    """The words of `text` packed greedily into lines of at most `width` characters (indent included).

    Whitespace runs collapse to one space. A word longer than a line is split across lines when
    `break_long_words` is true, else it sits alone on an over-long line.
    """
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    later = indent if subsequent_indent is None else subsequent_indent
    lines: list[str] = []
    current: list[str] = []
    prefix = indent
    for word in text.split():
        room = width - len(prefix)
        if break_long_words and len(word) > room and room > 0:
            if current:
                lines.append(prefix + " ".join(current))
                current, prefix = [], later
                room = width - len(prefix)
            *full, word = _chunks(word, room)
            for piece in full:
                lines.append(prefix + piece)
                prefix = later
        used = len(" ".join(current))
        if current and used + 1 + len(word) > width - len(prefix):
            lines.append(prefix + " ".join(current))
            current, prefix = [], later
        current.append(word)
    if current:
        lines.append(prefix + " ".join(current))
    return lines


def fill(text: str, width: int = 70, **options) -> str:
    """`wrap`'s lines joined with newlines."""
    return "\n".join(wrap(text, width, **options))


def justify(line: str, width: int) -> str:
    """`line` padded to `width` by widening the gaps between words; extra spaces go to the leftmost gaps."""
    words = line.split()
    if len(words) < 2 or len(line) >= width:
        return line
    gaps = len(words) - 1
    spaces = width - sum(len(w) for w in words)
    base, extra = divmod(spaces, gaps)
    out = words[0]
    for i, word in enumerate(words[1:]):
        out += " " * (base + (1 if i < extra else 0)) + word
    return out


def shorten(text: str, width: int, placeholder: str = " [...]") -> str:
    """`text` with whitespace collapsed; if longer than `width`, whole words dropped from the end and
    `placeholder` appended, so that the result fits in `width`."""
    words = text.split()
    joined = " ".join(words)
    if len(joined) <= width:
        return joined
    budget = width - len(placeholder)
    if budget < 0:
        raise ValueError(f"placeholder {placeholder!r} is longer than width {width}")
    kept: list[str] = []
    for word in words:
        if len(" ".join([*kept, word])) > budget:
            break
        kept.append(word)
    return (" ".join(kept) + placeholder).lstrip()


def dedent(text: str) -> str:
    """`text` with the whitespace prefix common to all its non-blank lines removed."""
    lines = text.split("\n")
    margin: str | None = None
    for line in lines:
        if not line.strip():
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if margin is None or len(indent) < len(margin):
            margin = indent
    if not margin:
        return text
    return "\n".join(line[len(margin) :] if line.strip() else "" for line in lines)
