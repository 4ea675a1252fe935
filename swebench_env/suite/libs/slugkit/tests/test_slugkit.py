import pytest

from slugkit import UniqueSlugger, ascii_fold, slugify


def test_simple_title():
    assert slugify("Hello World") == "hello-world"


def test_punctuation_collapses_to_one_separator():
    assert slugify("Hello,   World!!  -- again") == "hello-world-again"
    assert slugify("--leading and trailing--") == "leading-and-trailing"


def test_accents_are_folded():
    assert slugify("Crème Brûlée") == "creme-brulee"
    assert ascii_fold("Straße") == "Strasse"


def test_ampersand_is_spelled_out():
    assert slugify("Salt & Pepper") == "salt-and-pepper"


def test_custom_separator():
    assert slugify("Hello World", "_") == "hello_world"


def test_keeps_case_on_request():
    assert slugify("Hello World", lowercase=False) == "Hello-World"


def test_digits_are_kept():
    assert slugify("Top 10 tips for 2024") == "top-10-tips-for-2024"


def test_stopwords_are_removed():
    assert slugify("The Art of War", stopwords={"the", "of"}) == "art-war"


def test_stopwords_match_case_insensitively():
    assert slugify("The Art of War", stopwords={"THE", "Of"}, lowercase=False) == "Art-War"


def test_all_stopwords_keeps_the_words():
    assert slugify("the of", stopwords={"the", "of"}) == "the-of"


def test_truncates_at_word_boundary():
    assert slugify("a very long title indeed", max_length=12) == "a-very-long"
    assert slugify("a very long title indeed", max_length=13) == "a-very-long"


def test_truncation_keeps_exact_fit():
    assert slugify("a very long title", max_length=11) == "a-very-long"
    assert slugify("hello world", max_length=11) == "hello-world"


def test_truncation_cuts_a_single_long_word():
    assert slugify("internationalization", max_length=5) == "inter"


def test_max_length_must_be_positive():
    with pytest.raises(ValueError, match="max_length"):
        slugify("x", max_length=0)


def test_empty_text():
    assert slugify("") == ""
    assert slugify("!!!") == ""


def test_unique_slugger_numbers_repeats_from_two():
    slugs = UniqueSlugger()
    assert [slugs.slug("Hello"), slugs.slug("hello!"), slugs.slug("HELLO")] == ["hello", "hello-2", "hello-3"]


def test_unique_slugger_passes_options():
    slugs = UniqueSlugger("_", max_length=5)
    assert slugs.slug("hello world") == "hello"
    assert slugs.slug("hello there") == "hello_2"


def test_unique_slugger_names_empty_slugs():
    assert UniqueSlugger().slug("???") == "item"
