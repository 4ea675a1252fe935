from datetime import date

import pytest

from dateranges import DateRange, month_range, parse_range


def d(text):
    return date.fromisoformat(text)


def test_rejects_reversed_range():
    with pytest.raises(ValueError, match="before it starts"):
        DateRange(d("2024-01-02"), d("2024-01-01"))


def test_length_counts_both_ends():
    assert len(DateRange(d("2024-01-01"), d("2024-01-31"))) == 31
    assert len(DateRange(d("2024-05-05"), d("2024-05-05"))) == 1


def test_iteration_yields_every_day():
    days = list(DateRange(d("2024-02-27"), d("2024-03-01")))
    assert days == [d("2024-02-27"), d("2024-02-28"), d("2024-02-29"), d("2024-03-01")]


def test_contains():
    r = DateRange(d("2024-01-10"), d("2024-01-20"))
    assert d("2024-01-10") in r
    assert d("2024-01-20") in r
    assert d("2024-01-21") not in r


def test_overlaps():
    a = DateRange(d("2024-01-01"), d("2024-01-10"))
    assert a.overlaps(DateRange(d("2024-01-05"), d("2024-02-01")))
    assert not a.overlaps(DateRange(d("2024-01-11"), d("2024-01-12")))


def test_ranges_sharing_one_day_overlap():
    a = DateRange(d("2024-01-01"), d("2024-01-10"))
    b = DateRange(d("2024-01-10"), d("2024-01-15"))
    assert a.overlaps(b)
    assert a.intersection(b) == DateRange(d("2024-01-10"), d("2024-01-10"))


def test_intersection():
    a = DateRange(d("2024-01-01"), d("2024-01-10"))
    b = DateRange(d("2024-01-05"), d("2024-02-01"))
    assert a.intersection(b) == DateRange(d("2024-01-05"), d("2024-01-10"))
    assert a.intersection(DateRange(d("2024-03-01"), d("2024-03-02"))) is None


def test_shift():
    assert DateRange(d("2024-01-30"), d("2024-01-31")).shift(2) == DateRange(d("2024-02-01"), d("2024-02-02"))


def test_str_and_parse_round_trip():
    r = parse_range("2024-01-01..2024-03-31")
    assert str(r) == "2024-01-01..2024-03-31"
    assert parse_range(" 2024-01-01 .. 2024-01-02 ") == DateRange(d("2024-01-01"), d("2024-01-02"))


def test_parse_single_day():
    assert parse_range("2024-06-01") == DateRange(d("2024-06-01"), d("2024-06-01"))


def test_month_range():
    assert month_range(2024, 2) == DateRange(d("2024-02-01"), d("2024-02-29"))
    assert month_range(2023, 4) == DateRange(d("2023-04-01"), d("2023-04-30"))


def test_month_range_december():
    assert month_range(2023, 12) == DateRange(d("2023-12-01"), d("2023-12-31"))


def test_month_range_rejects_bad_month():
    with pytest.raises(ValueError, match="month must be 1 to 12"):
        month_range(2024, 13)


def test_split_by_month():
    parts = parse_range("2024-01-15..2024-03-10").split_by_month()
    assert [str(p) for p in parts] == ["2024-01-15..2024-01-31", "2024-02-01..2024-02-29", "2024-03-01..2024-03-10"]


def test_split_by_month_across_new_year():
    parts = parse_range("2023-12-20..2024-01-05").split_by_month()
    assert [str(p) for p in parts] == ["2023-12-20..2023-12-31", "2024-01-01..2024-01-05"]


def test_weeks_start_on_monday():
    parts = parse_range("2024-01-03..2024-01-16").weeks()
    assert [str(p) for p in parts] == ["2024-01-03..2024-01-07", "2024-01-08..2024-01-14", "2024-01-15..2024-01-16"]


def test_weeks_custom_first_day():
    parts = parse_range("2024-01-03..2024-01-09").weeks(first_weekday=6)
    assert [str(p) for p in parts] == ["2024-01-03..2024-01-06", "2024-01-07..2024-01-09"]


def test_business_days_skip_weekends():
    assert parse_range("2024-01-01..2024-01-07").business_days() == 5
    assert month_range(2024, 2).business_days() == 21


def test_business_days_skip_holidays():
    week = parse_range("2024-01-01..2024-01-07")
    assert week.business_days(holidays=[d("2024-01-01"), d("2024-01-06")]) == 4
