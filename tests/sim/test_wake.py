"""The simulator's wake-ups (`Simulation.wake`, scheduled as `runner._Call` SimPy events) against
SimPy's own timeouts: same order (time, then scheduling order, ties included), same clock, and the
engines' O(1) request count against the list it replaces."""

from __future__ import annotations

import simpy

from sim.runner import Simulation


def _timeline(schedule) -> list[tuple[float, str]]:
    """Run `schedule(env, wake, log)` and return the (time, label) log."""
    env, log = simpy.Environment(), []
    schedule(env, log)
    env.run()
    return log


def _with_timeouts(env: simpy.Environment, delay: float, fn, *args) -> None:
    timeout = env.timeout(max(0.0, delay))
    timeout.callbacks.append(lambda _: fn(*args))


def _scenario(wake):
    def schedule(env, log):
        def note(label, again=None):
            log.append((env.now, label))
            if again is not None:
                wake(env, again, note, label + "'")

        wake(env, 1.0, note, "a", 0.0)  # a's follow-up lands at 1.0, after c (scheduled earlier)
        wake(env, 2.0, note, "b")
        wake(env, 1.0, note, "c", -1.0)  # a negative delay counts as 0
        wake(env, 0.0, note, "d")
        env.timeout(1.0).callbacks.append(lambda _: log.append((env.now, "simpy")))

    return schedule


class _Host:
    """The two attributes `Simulation.wake` uses."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env, self.events_scheduled = env, 0


def _with_calls(env: simpy.Environment, delay: float, fn, *args) -> None:
    Simulation.wake(_Host(env), delay, fn, *args)


def test_wake_ups_keep_simpy_timeout_order():
    expected = [(0.0, "d"), (1.0, "a"), (1.0, "c"), (1.0, "simpy"), (1.0, "a'"), (1.0, "c'"), (2.0, "b")]
    assert _timeline(_scenario(_with_timeouts)) == expected
    assert _timeline(_scenario(_with_calls)) == expected


def test_wake_ups_are_counted(small_config):
    sim = Simulation.from_config(small_config("num_steps=1"), "tag")
    sim.run()
    assert sim.events_scheduled > 0


def test_an_engine_counts_its_requests_without_listing_them(small_config):
    sim = Simulation.from_config(small_config("num_steps=1", "rollout.gpu_memory_utilization=0.6"), "streaming")
    seen, take_for = [], sim.take_for

    def checked(engine, limit=None):
        seen.append((engine.num_active, len(engine.active)))
        return take_for(engine, limit)

    sim.take_for = checked
    sim.run()
    assert seen
    assert [count for count, _ in seen] == [listed for _, listed in seen]
