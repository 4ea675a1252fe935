"""Routing: least loaded, session affinity within a slack, failed engines skipped for a cooldown."""

from __future__ import annotations

import pytest

from reference.engine.fake import FakeEngine
from reference.manager.router import NoEngineAvailable, Router


def make(n: int = 3, **kw) -> Router:
    return Router({f"e{i}": FakeEngine() for i in range(n)}, **kw)


def test_least_loaded_then_sticky():
    r = make(3, affinity_slack=1)
    picks = []
    for session in ("a", "b", "c"):
        slot = r.choose(session)
        r.acquire(slot)
        picks.append(slot.name)
    assert picks == ["e0", "e1", "e2"]  # each new session goes to the least loaded engine
    r.acquire(r.slots[0])  # e0 now has 2 in flight, the others 1: within the slack of 1
    assert r.choose("a").name == "e0"
    r.acquire(r.slots[0])  # 3 vs 1: beyond the slack, "a" moves to the least loaded engine
    assert r.choose("a").name == "e1"
    assert r.choose("a").name == "e1"  # and sticks there


def test_release_and_failure_cooldown(monkeypatch):
    import reference.manager.router as router_module

    now = [100.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: now[0])
    r = make(2, cooldown_s=5.0)
    first = r.choose("s")
    r.mark_failed(first)
    assert r.choose("s").name != first.name
    with pytest.raises(NoEngineAvailable, match="2 configured"):
        r.choose("s", exclude={s.name for s in r.slots if s is not first})
    now[0] += 5.0
    assert r.choose("u", exclude={s.name for s in r.slots if s is not first}).name == first.name
    stats = {s["name"]: s for s in r.stats()}
    assert stats[first.name]["failures"] == 1 and stats[first.name]["up"]


def test_needs_an_engine():
    with pytest.raises(ValueError, match="at least one engine"):
        Router({})


def test_cooldown_doubles_with_failures_in_a_row_and_resets(monkeypatch):
    import reference.manager.router as router_module

    now = [0.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: now[0])
    r = make(1, cooldown_s=5.0, max_cooldown_s=30.0)
    slot = r.slots[0]
    downs = []
    for _ in range(5):
        r.mark_failed(slot, "stalled")
        downs.append(slot.down_until - now[0])
    assert downs == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert r.stats()[0]["reason"] == "stalled" and not r.stats()[0]["up"]
    r.mark_ok(slot)
    r.mark_failed(slot)
    assert slot.down_until - now[0] == 5.0
    r.hold_down(slot, "restarting")
    now[0] += 100
    with pytest.raises(NoEngineAvailable):
        r.choose("s")
    r.bring_up(slot)
    assert r.choose("s") is slot
