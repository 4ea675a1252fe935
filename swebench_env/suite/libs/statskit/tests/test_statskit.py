import pytest

from statskit import histogram, mean, median, mode, moving_average, percentile, stdev, variance, zscores


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_empty_data_is_an_error():
    with pytest.raises(ValueError, match="mean needs at least 1 value, got 0"):
        mean([])


def test_median_odd_count():
    assert median([5, 1, 3]) == 3.0


def test_median_even_count_averages_the_middle():
    assert median([3, 1, 4, 1]) == 2.0
    assert median([10, 20]) == 15.0


def test_mode_picks_most_common():
    assert mode([1, 2, 2, 3]) == 2


def test_mode_ties_go_to_the_smallest():
    assert mode([3, 3, 1, 1, 2]) == 1


def test_percentile_endpoints():
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile([4, 1, 3, 2], 100) == 4


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 25) == 1.75
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20, 30], 90) == 28.0


def test_percentile_range_is_checked():
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1], 101)


def test_sample_variance_divides_by_n_minus_one():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9]) == pytest.approx(32 / 7)


def test_population_variance():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9], population=True) == 4.0
    assert stdev([2, 4, 4, 4, 5, 5, 7, 9], population=True) == 2.0


def test_sample_variance_needs_two_values():
    with pytest.raises(ValueError, match="at least 2 values"):
        variance([1])


def test_zscores():
    assert zscores([1, 2, 3]) == [-1.0, 0.0, 1.0]


def test_zscores_of_constant_data():
    with pytest.raises(ValueError, match="undefined"):
        zscores([2, 2, 2])


def test_moving_average():
    assert moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]
    assert moving_average([1, 2, 3], 3) == [2.0]


def test_moving_average_window_longer_than_data():
    assert moving_average([1, 2], 3) == []


def test_histogram():
    assert histogram([0, 1, 2, 3, 4, 5], bins=5, lo=0, hi=5) == [1, 1, 1, 1, 2]
    assert histogram([-1, 0.25, 9], bins=2, lo=0, hi=1) == [1, 0]
