import pytest

from intervalset import Interval, IntervalSet


def test_interval_length_and_contains():
    item = Interval(2, 5)
    assert item.length == 3
    assert item.contains(2)
    assert not item.contains(5)


def test_overlaps_needs_a_shared_point():
    assert Interval(0, 3).overlaps(Interval(2, 4))
    assert not Interval(0, 3).overlaps(Interval(3, 4))


def test_add_keeps_intervals_sorted():
    s = IntervalSet([(10, 12), (1, 2), (5, 6)])
    assert list(s) == [(1, 2), (5, 6), (10, 12)]


def test_add_merges_overlapping_intervals():
    s = IntervalSet([(1, 4), (3, 8)])
    assert list(s) == [(1, 8)]


def test_add_merges_touching_intervals():
    s = IntervalSet([(1, 3), (3, 5)])
    assert list(s) == [(1, 5)]
    assert len(s) == 1


def test_add_bridges_several_intervals():
    s = IntervalSet([(1, 2), (4, 5), (7, 8)])
    s.add(2, 7)
    assert list(s) == [(1, 8)]


def test_add_ignores_empty_interval():
    s = IntervalSet()
    s.add(3, 3)
    assert not s


def test_add_rejects_reversed_interval():
    with pytest.raises(ValueError, match="after its end"):
        IntervalSet().add(5, 1)


def test_contains_start_but_not_end():
    s = IntervalSet([(1, 3), (5, 8)])
    assert 1 in s
    assert 2.5 in s
    assert 5 in s


def test_end_point_is_not_contained():
    s = IntervalSet([(1, 3), (5, 8)])
    assert 3 not in s
    assert 8 not in s
    assert 4 not in s
    assert 0 not in s


def test_remove_from_the_edge():
    s = IntervalSet([(0, 10)])
    s.remove(0, 4)
    assert list(s) == [(4, 10)]


def test_remove_from_the_middle_splits():
    s = IntervalSet([(0, 10)])
    s.remove(4, 6)
    assert list(s) == [(0, 4), (6, 10)]


def test_remove_everything():
    s = IntervalSet([(1, 2), (3, 4)])
    s.remove(0, 10)
    assert list(s) == []


def test_total_length():
    assert IntervalSet([(0, 2), (5, 6.5)]).total_length() == 3.5


def test_span():
    assert IntervalSet().span() is None
    assert IntervalSet([(4, 5), (1, 2)]).span() == (1, 5)


def test_union_operator():
    a = IntervalSet([(0, 2)])
    b = IntervalSet([(1, 5), (8, 9)])
    assert list(a | b) == [(0, 5), (8, 9)]


def test_intersection_of_single_intervals():
    a = IntervalSet([(0, 5)])
    b = IntervalSet([(3, 8)])
    assert list(a & b) == [(3, 5)]


def test_intersection_walks_both_lists():
    a = IntervalSet([(0, 4), (6, 10)])
    b = IntervalSet([(1, 2), (3, 7), (9, 12)])
    assert list(a & b) == [(1, 2), (3, 4), (6, 7), (9, 10)]


def test_complement_inside_bounds():
    busy = IntervalSet([(9, 10), (11, 17)])
    assert list(busy.complement(8, 18)) == [(8, 9), (10, 11), (17, 18)]


def test_complement_of_empty_set_is_the_bounds():
    assert list(IntervalSet().complement(0, 5)) == [(0, 5)]


def test_gaps():
    s = IntervalSet([(0, 1), (3, 4), (6, 9)])
    assert s.gaps() == [(1, 3), (4, 6)]


def test_equality_and_repr():
    assert IntervalSet([(1, 2)]) == IntervalSet([(1, 2)])
    assert repr(IntervalSet([(1, 2)])) == "IntervalSet([(1, 2)])"
