"""Engine supervision: dead engines come back with the fleet's weights, frozen ones stop getting requests."""

from __future__ import annotations

import os
import signal

import pytest

from reference.engine.fake import FakeConfig
from reference.engine.process import EngineProcess, EngineSpec
from reference.manager.embedded import ManagerThread
from reference.manager.manager import ManagerConfig
from reference.manager.supervisor import SupervisorConfig

MODEL = "seamlessflow-tiny"
FAST = SupervisorConfig(interval_s=0.2, probe_timeout_s=1.0, probes_to_hold=2, restart_after_s=1.5, max_backoff_s=2.0)


def say(text: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 6}


@pytest.fixture
def supervised(tok, tmp_path):
    """`supervised(n)` -> (ManagerThread, [EngineProcess]): fake engine processes the manager may restart."""
    opened: list = []

    def make(n: int) -> tuple[ManagerThread, list[EngineProcess]]:
        procs = [EngineProcess(EngineSpec(backend="fake", options=FakeConfig(reply_tokens=4))) for _ in range(n)]
        opened.extend(procs)
        names = {f"e{i}": p for i, p in enumerate(procs)}
        m = ManagerThread({k: p.client(stall_timeout_s=5.0) for k, p in names.items()}, tok, tmp_path / "t.sqlite",
                          ManagerConfig(default_max_tokens=8), processes=names, supervisor=FAST)  # fmt: skip
        opened.append(m)
        return m, procs

    yield make
    for item in reversed(opened):
        item.close()


def engine_stats(http, m, name: str) -> dict:
    return next(e for e in http("GET", f"{m.url}/stats")[1]["engines"] if e["name"] == name)


def test_a_dead_engine_is_restarted_with_the_fleets_weights(wait_for, supervised, http):
    m, (proc,) = supervised(1)
    for step in ("pause", "update_weights", "resume"):
        assert http("POST", f"{m.url}/admin/{step}", {"version": 3, "source": None})[0] == 200
    old_pid = proc.pid
    proc.kill()
    wait_for(lambda: engine_stats(http, m, "e0")["restarts"] == 1 and engine_stats(http, m, "e0")["up"],
             what="the engine to be restarted")  # fmt: skip
    assert proc.pid != old_pid and proc.alive()
    status, body = http("POST", f"{m.base_url('after')}/chat/completions", say("are you back?"))
    assert status == 200, body
    assert set(body["trajectory"]["versions"]) == {3}  # the restarted engine was given the fleet's version
    assert http("GET", f"{m.url}/health")[1]["status"] == "ok"


def test_a_frozen_engine_is_held_down_then_restarted(wait_for, supervised, http):
    m, (frozen, healthy) = supervised(2)
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not engine_stats(http, m, "e0")["up"], what="the frozen engine to be held down")
        status, health = http("GET", f"{m.url}/health")
        assert status == 200 and health["status"] == "degraded" and "engine e0 is down" in health["reasons"][0]
        for i in range(4):  # new sessions go to the healthy engine, without waiting out a stall
            status, body = http("POST", f"{m.base_url(f's{i}')}/chat/completions", say("hello"))
            assert status == 200 and body["choices"][0]["message"]["content"] is not None
        assert engine_stats(http, m, "e0")["served"] == 0
        wait_for(lambda: engine_stats(http, m, "e0")["restarts"] == 1 and engine_stats(http, m, "e0")["up"],
                 what="the frozen engine to be restarted")  # fmt: skip
    finally:
        if frozen.alive():
            os.kill(frozen.pid, signal.SIGCONT)
    assert http("GET", f"{m.url}/health")[1]["status"] == "ok"
