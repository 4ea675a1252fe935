import pytest

from semver import Version, satisfies


def v(text):
    return Version.parse(text)


def test_parse_full_version():
    parsed = v("1.4.0-rc.1+build.5")
    assert (parsed.major, parsed.minor, parsed.patch) == (1, 4, 0)
    assert parsed.prerelease == ("rc", "1")
    assert parsed.build == ("build", "5")


def test_parse_rejects_bad_versions():
    for text in ("1.2", "01.2.3", "1.2.3-", "v1.2.3"):
        with pytest.raises(ValueError, match="not a semantic version"):
            v(text)


def test_str_round_trip():
    for text in ("0.0.1", "1.4.0-rc.1+build.5", "2.0.0+meta"):
        assert str(v(text)) == text


def test_core_precedence():
    assert v("1.2.3") < v("1.2.4") < v("1.3.0") < v("2.0.0")
    assert v("1.10.0") > v("1.9.0")


def test_prerelease_sorts_before_release():
    assert v("1.0.0-alpha") < v("1.0.0")
    assert v("1.0.0") > v("1.0.0-rc.1")


def test_prerelease_precedence_chain():
    chain = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2", "1.0.0-beta.11",
             "1.0.0-rc.1", "1.0.0"]  # fmt: skip
    versions = [v(t) for t in chain]
    assert sorted(reversed(versions)) == versions


def test_numeric_identifiers_compare_as_numbers():
    assert v("1.0.0-rc.2") < v("1.0.0-rc.10")


def test_build_metadata_is_ignored():
    assert v("1.0.0+a") == v("1.0.0+b")
    assert len({v("1.0.0+a"), v("1.0.0")}) == 1


def test_bump_major_and_minor_reset_lower_parts():
    assert str(v("1.4.7").bump_major()) == "2.0.0"
    assert str(v("1.4.7").bump_minor()) == "1.5.0"


def test_bump_patch():
    assert str(v("1.4.7").bump_patch()) == "1.4.8"
    assert str(v("1.4.7-rc.1").bump_patch()) == "1.4.7"


def test_comparison_clauses():
    assert satisfies("1.5.0", ">=1.2.0 <2.0.0")
    assert not satisfies("2.1.0", ">=1.0.0 <2.0.0")
    assert satisfies("1.2.3", "=1.2.3")
    assert satisfies("1.2.3", "1.2.3")
    assert not satisfies("1.2.3", ">1.2.3")
    assert satisfies("1.2.3", "<=1.2.3")


def test_caret_allows_minor_and_patch_updates():
    assert satisfies("1.9.3", "^1.2.0")
    assert not satisfies("2.0.0", "^1.2.0")
    assert not satisfies("1.1.9", "^1.2.0")


def test_caret_on_zero_major_allows_patch_updates_only():
    assert satisfies("0.2.5", "^0.2.1")
    assert not satisfies("0.3.0", "^0.2.1")
    assert not satisfies("0.0.4", "^0.0.3")


def test_tilde_allows_patch_updates():
    assert satisfies("1.2.9", "~1.2.3")
    assert not satisfies("1.3.0", "~1.2.3")


def test_ranges_exclude_next_prereleases():
    assert not satisfies("2.0.0-alpha", "^1.2.0")


def test_empty_range_is_an_error():
    with pytest.raises(ValueError, match="empty version range"):
        satisfies("1.0.0", "  ")
