import pytest

from lrucache import CacheStats, LRUCache, memoize


def test_get_and_put():
    cache = LRUCache(2)
    cache.put("a", 1)
    assert cache.get("a") == 1
    assert cache.get("zzz") is None
    assert cache.get("zzz", 0) == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        LRUCache(0)


def test_holds_up_to_capacity():
    cache = LRUCache(3)
    for key in "abc":
        cache.put(key, key.upper())
    assert len(cache) == 3
    assert cache.keys() == ["a", "b", "c"]


def test_evicts_least_recently_used():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)
    assert "a" not in cache
    assert cache.keys() == ["b", "c"]


def test_get_refreshes_recency():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")
    cache.put("c", 3)
    assert cache.keys() == ["a", "c"]


def test_put_existing_key_refreshes_and_updates():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 10)
    cache.put("c", 3)
    assert cache.keys() == ["a", "c"]
    assert cache.peek("a") == 10


def test_peek_does_not_refresh():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.peek("a") == 1
    cache.put("c", 3)
    assert cache.keys() == ["b", "c"]
    assert cache.stats().hits == 0


def test_pop():
    cache = LRUCache(2)
    cache.put("a", 1)
    assert cache.pop("a") == 1
    assert cache.pop("a", None) is None
    with pytest.raises(KeyError):
        cache.pop("a")


def test_resize_evicts_oldest():
    cache = LRUCache(4)
    for key in "abcd":
        cache.put(key, 0)
    cache.resize(2)
    assert cache.keys() == ["c", "d"]
    assert cache.capacity == 2


def test_stats_count_hits_and_misses():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.get("a")
    cache.get("a")
    cache.get("b")
    assert cache.stats() == CacheStats(hits=2, misses=1, size=1, capacity=2)


def test_hit_rate():
    assert CacheStats(hits=3, misses=1, size=0, capacity=1).hit_rate == 0.75
    assert CacheStats(hits=0, misses=0, size=0, capacity=1).hit_rate == 0.0


def test_clear_resets_everything():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.get("a")
    cache.clear()
    assert cache.stats() == CacheStats(0, 0, 0, 2)


def test_memoize_caches_results():
    calls = []

    @memoize(maxsize=8)
    def square(x):
        calls.append(x)
        return x * x

    assert [square(3), square(3), square(4)] == [9, 9, 16]
    assert calls == [3, 4]
    assert square.cache.stats().hits == 1


def test_memoize_keys_include_keyword_arguments():
    @memoize()
    def power(x, exponent=2):
        return x**exponent

    assert power(2) == 4
    assert power(2, exponent=3) == 8
    assert power(2, exponent=5) == 32


def test_memoize_respects_maxsize():
    @memoize(maxsize=2)
    def ident(x):
        return x

    for x in range(5):
        ident(x)
    assert len(ident.cache) == 2


def test_memoize_keeps_metadata_and_clears():
    @memoize()
    def documented(x):
        """Docs."""
        return x

    documented(1)
    documented.cache_clear()
    assert documented.__name__ == "documented"
    assert documented.__doc__ == "Docs."
    assert len(documented.cache) == 0
