"""Engines in their own processes behind HTTP: retry on a killed engine, a clean 503, no corruption."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from reference.engine.base import EngineError, GenerateRequest, SamplingParams, generate
from reference.engine.client import HTTPEngine
from reference.engine.fake import FakeConfig, FakeEngine
from reference.engine.process import EngineProcess, EngineSpec
from reference.manager.embedded import ManagerThread
from reference.manager.manager import ManagerConfig

MODEL = "seamlessflow-tiny"


@pytest.fixture
def fake_procs():
    procs: list[EngineProcess] = []

    def make(n: int, token: str | None = None, heartbeat_s: float = 5.0, **options) -> list[EngineProcess]:
        spec = EngineSpec(backend="fake", heartbeat_s=heartbeat_s, options=FakeConfig(**options))
        procs.extend(EngineProcess(spec, token=token) for _ in range(n))
        return procs[-n:]

    yield make
    for p in procs:
        p.close()


def test_http_engine_round_trip_and_errors(fake_procs, tok):
    (proc,) = fake_procs(1, reply_tokens=5)

    async def main():
        client = proc.client()
        try:
            req = GenerateRequest("r1", (1, 2, 3), SamplingParams(max_tokens=20, stop_token_ids=(tok.im_end_id,)))
            result = await generate(client, req)
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await generate(client, GenerateRequest("r2", (10**7,), SamplingParams(max_tokens=2)))
            with pytest.raises(RuntimeError, match="pause"):
                await client.update_weights(1)
            await client.pause()
            await client.update_weights(2)
            await client.resume()
            stats = await client.stats()
            return result, stats
        finally:
            await client.close()

    result, stats = asyncio.run(main())
    expected, context = [], [1, 2, 3]
    for _ in range(4):
        expected.append(FakeEngine.next_token(context, 0, tok.vocab_size))
        context.append(expected[-1])
    assert list(result.token_ids) == [*expected, tok.im_end_id]
    assert str(result.finish_reason) == "stop" and stats.version == 2 and stats.running == 0


def test_unreachable_engine_is_an_engine_error():
    async def main():
        client = HTTPEngine("http://127.0.0.1:9", connect_timeout_s=1)
        try:
            await generate(client, GenerateRequest("x", (1,), SamplingParams(max_tokens=2)))
        finally:
            await client.close()

    with pytest.raises(EngineError):
        asyncio.run(main())


def test_an_engine_process_demands_its_token(fake_procs):
    (proc,) = fake_procs(1)
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        argv = f.read().decode()

    async def main():
        stranger = HTTPEngine(proc.url)
        owner = proc.client()
        try:
            with pytest.raises(EngineError, match="refused the token"):
                await stranger.stats()
            return await owner.stats()
        finally:
            await stranger.close()
            await owner.close()

    assert asyncio.run(main()).running == 0
    assert len(proc.token) >= 32
    assert proc.token not in argv  # `ps` shows the command line


def test_an_engine_process_takes_a_given_token(fake_procs):
    (proc,) = fake_procs(1, token="given-token")

    async def main():
        client = HTTPEngine(proc.url, token="given-token")
        try:
            return await generate(client, GenerateRequest("r", (1, 2), SamplingParams(max_tokens=3)))
        finally:
            await client.close()

    assert proc.token == "given-token"
    assert len(asyncio.run(main()).token_ids) == 3


def test_an_engine_process_gets_its_own_token_and_not_the_managers(fake_procs, monkeypatch):
    from reference.engine.auth import MANAGER_TOKEN_ENV, TOKEN_ENV

    monkeypatch.setenv(MANAGER_TOKEN_ENV, "the-managers-control-token")
    (proc,) = fake_procs(1, token="engine-token")
    env = dict(v.split("=", 1) for v in Path(f"/proc/{proc.pid}/environ").read_text().split("\0") if "=" in v)
    assert env[TOKEN_ENV] == "engine-token" and MANAGER_TOKEN_ENV not in env


def test_restart_replaces_a_dead_or_live_child_with_the_same_token(fake_procs):
    (proc,) = fake_procs(1)
    client = proc.client()

    async def served(rid: str) -> int:
        result = await generate(client, GenerateRequest(rid, (1, 2), SamplingParams(max_tokens=3)))
        return len(result.token_ids)

    async def main():
        try:
            outcomes = [await served("before")]
            first_pid = proc.pid
            proc.kill()  # a crash
            outcomes.append(await client.health())
            proc.restart(start_timeout_s=60)
            client.base_url = proc.url
            outcomes += [await client.health(), await served("after crash"), proc.pid != first_pid]
            live_pid = proc.pid
            proc.restart(start_timeout_s=60)  # a hung but live child is killed first
            client.base_url = proc.url + "/"
            outcomes += [await served("after restart"), proc.pid != live_pid, _gone(live_pid)]
            return outcomes
        finally:
            await client.close()

    assert asyncio.run(main()) == [3, False, True, 3, True, 3, True, True]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_child_that_never_announces_its_port_times_out(monkeypatch):
    """A child that starts but never announces its port."""
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr("reference.engine.process.engine_argv", lambda spec, host, port: silent)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not start within 1.0 s"):
        EngineProcess(EngineSpec(backend="fake"), start_timeout_s=1.0)
    assert time.monotonic() - started < 30


def _chat_in_background(m: ManagerThread, session: str, openai_client) -> tuple[threading.Thread, dict]:
    """Start one chat request from another thread; its response lands in result["r"]."""
    result: dict = {}

    def agent() -> None:
        with openai_client(m.base_url(session)) as client:
            result["r"] = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}])

    thread = threading.Thread(target=agent)
    thread.start()
    return thread, result


def _serving_slot(manager, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = [s for s in manager.router.slots if s.in_flight]
        if busy:
            return busy[0]
        time.sleep(0.005)
    raise AssertionError("no engine picked up the request")


def test_killed_engine_mid_generation_is_retried_elsewhere(fake_procs, tok, tmp_path, openai_client, http):
    procs = fake_procs(2, reply_tokens=60, token_delay_s=0.02)
    engines = {f"e{i}": p.client() for i, p in enumerate(procs)}
    with ManagerThread(engines, tok, tmp_path / "t.sqlite", ManagerConfig(default_max_tokens=80)) as m:
        t, result = _chat_in_background(m, "crash", openai_client)
        slot = _serving_slot(m.manager)
        time.sleep(0.3)  # some tokens from the first engine
        procs[int(slot.name[1:])].kill()
        t.join(60)
        assert not t.is_alive(), "the agent's request did not finish within 60 s of the kill"
        r = result["r"]
        traj = r.model_extra["trajectory"]
        assert r.choices[0].finish_reason in ("stop", "length") and len(traj["token_ids"]) > 20
        assert sorted(s.failures for s in m.manager.router.slots) == [0, 1]
        # The continuation on the other engine gives exactly the tokens of an uninterrupted run.
        status, tree = http("GET", f"{m.url}/trajectories/crash")
        (branch,) = tree["branches"]
        prompt_len = branch["generated_mask"].index(1)
        context = branch["token_ids"][:prompt_len]
        tokens = traj["token_ids"]
        if tokens[-1] in (tok.im_end_id, tok.eos_token_id):  # the fake's count-forced stop token
            tokens = tokens[:-1]
        for token in tokens:
            assert token == FakeEngine.next_token(context, 0, tok.vocab_size)
            context.append(token)
        assert branch["token_ids"] == [*branch["token_ids"][:prompt_len], *traj["token_ids"]]


def test_all_engines_dead_is_a_clean_503(fake_procs, tok, tmp_path, http):
    procs = fake_procs(2, reply_tokens=5)
    engines = {f"e{i}": p.client() for i, p in enumerate(procs)}
    with ManagerThread(engines, tok, tmp_path / "t.sqlite") as m:
        ok, _ = http("POST", f"{m.base_url('dead')}/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": "a"}]})  # fmt: skip
        assert ok == 200
        _, before = http("GET", f"{m.url}/trajectories/dead")
        for p in procs:
            p.kill()
        status, err = http("POST", f"{m.base_url('dead')}/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "b"}]})  # fmt: skip
        assert status == 503 and err["error"]["code"] == "engine_unavailable"
        _, after = http("GET", f"{m.url}/trajectories/dead")
        assert after == before
        status, health = http("GET", f"{m.url}/health")
        assert status == 503, health  # the manager says it cannot serve
        assert health["status"] == "unhealthy" and "no engine is up" in health["reasons"]


def test_frozen_engine_is_detected_by_the_stall_timeout(fake_procs, tok, tmp_path, openai_client):
    """A process that is alive but sends nothing (SIGSTOP) fails its streams after the stall timeout."""
    import os
    import signal

    procs = fake_procs(2, reply_tokens=40, token_delay_s=0.02, heartbeat_s=0.2)
    engines = {f"e{i}": p.client(stall_timeout_s=3.0) for i, p in enumerate(procs)}
    with ManagerThread(engines, tok, tmp_path / "t.sqlite", ManagerConfig(default_max_tokens=60)) as m:
        t, result = _chat_in_background(m, "frozen", openai_client)
        slot = _serving_slot(m.manager)
        time.sleep(0.2)
        frozen = procs[int(slot.name[1:])]
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            t.join(30)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        assert not t.is_alive(), "the agent's request did not finish within 30 s of the freeze"
        assert result["r"].choices[0].finish_reason in ("stop", "length")
        assert sorted(s.failures for s in m.manager.router.slots) == [0, 1]


def test_a_pause_longer_than_the_stall_timeout_is_not_a_failure(fake_procs, tok, tmp_path, openai_client):
    (proc,) = fake_procs(1, reply_tokens=100, token_delay_s=0.02, heartbeat_s=0.2)
    config = ManagerConfig(default_max_tokens=120)
    with ManagerThread({"e0": proc.client(stall_timeout_s=2.0)}, tok, tmp_path / "t.sqlite", config) as m:
        t, result = _chat_in_background(m, "patient", openai_client)
        _serving_slot(m.manager)
        m.call(m.manager.pause())
        time.sleep(5.0)  # 2.5 stall timeouts of silence but for heartbeats
        m.call(m.manager.update_weights(1))
        m.call(m.manager.resume())
        t.join(30)
        assert not t.is_alive(), "the agent's request did not finish within 30 s of the resume"
        versions = result["r"].model_extra["trajectory"]["versions"]
        assert m.manager.router.slots[0].failures == 0 and versions[-1] == 1


def test_the_builtin_engine_process_hands_the_interpreter_over_often():
    """The built-in engine's worker thread and its HTTP loop share the interpreter: the builtin backend's
    factory shortens the switch interval of the process it runs in (measured: decode steps without convoys
    behind the loop)."""
    from reference.engine.builtin import SWITCH_INTERVAL_S
    from reference.engine.process import make_engine

    before = sys.getswitchinterval()
    try:
        engine = make_engine(EngineSpec(backend="builtin", max_batch=2))
        try:
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        finally:
            engine.close()
    finally:
        sys.setswitchinterval(before)
