import pytest

from wraptext import dedent, fill, justify, shorten, wrap

FOX = "The quick brown fox jumps over the lazy dog"


def test_wrap_packs_words_greedily():
    assert wrap(FOX, 15) == ["The quick brown", "fox jumps over", "the lazy dog"]


def test_wrap_allows_lines_of_exactly_width():
    assert wrap("aaaa bbbb cccc", 9) == ["aaaa bbbb", "cccc"]
    assert all(len(line) <= 9 for line in wrap(FOX, 9))


def test_wrap_collapses_whitespace():
    assert wrap("  one\n\ttwo   three ", 40) == ["one two three"]


def test_wrap_empty_text():
    assert wrap("", 10) == []
    assert wrap("   ", 10) == []


def test_wrap_default_width_is_70():
    text = " ".join(["word"] * 30)
    assert max(len(line) for line in wrap(text)) <= 70
    assert len(wrap(text)[0]) > 60


def test_wrap_breaks_long_words_by_default():
    assert wrap("abcdefghij", 4) == ["abcd", "efgh", "ij"]
    assert wrap("hi abcdefghij", 4) == ["hi", "abcd", "efgh", "ij"]


def test_wrap_can_keep_long_words_whole():
    assert wrap("hi abcdefghij", 4, break_long_words=False) == ["hi", "abcdefghij"]


def test_wrap_indents():
    assert wrap("one two three four", 10, indent="> ") == ["> one two", "> three", "> four"]
    assert wrap("one two three four", 10, indent="* ", subsequent_indent="  ") == ["* one two", "  three", "  four"]


def test_wrap_rejects_zero_width():
    with pytest.raises(ValueError, match="width must be at least 1"):
        wrap("x", 0)


def test_fill_joins_lines():
    assert fill(FOX, 15) == "The quick brown\nfox jumps over\nthe lazy dog"


def test_justify_spreads_spaces_evenly():
    assert justify("fox jumps over", 18) == "fox   jumps   over"


def test_justify_gives_extra_spaces_to_the_left():
    assert justify("a b c d", 11) == "a   b  c  d"
    assert len(justify("the lazy dog", 16)) == 16


def test_justify_leaves_single_words_and_full_lines():
    assert justify("word", 10) == "word"
    assert justify("exactly ten", 11) == "exactly ten"


def test_shorten_keeps_short_text():
    assert shorten("Hello   world", 20) == "Hello world"
    assert shorten("Hello world", 11) == "Hello world"


def test_shorten_drops_words_and_fits_width():
    assert shorten("Hello there, world", 12) == "Hello [...]"
    assert len(shorten(FOX, 25)) <= 25
    assert shorten(FOX, 25) == "The quick brown fox [...]"


def test_shorten_custom_placeholder():
    assert shorten(FOX, 20, placeholder="...") == "The quick brown..."


def test_shorten_placeholder_too_long():
    with pytest.raises(ValueError, match="longer than width"):
        shorten(FOX, 3)


def test_dedent_removes_common_margin():
    assert dedent("    a\n      b\n    c") == "a\n  b\nc"


def test_dedent_ignores_blank_lines():
    assert dedent("    a\n\n    b") == "a\n\nb"
    assert dedent("    a\n  \n    b") == "a\n\nb"


def test_dedent_without_margin():
    assert dedent("a\n  b") == "a\n  b"
