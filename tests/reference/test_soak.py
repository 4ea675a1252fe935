"""Soak: 256 agent sessions against three supervised engine processes while everything goes wrong at once.

Agents walk away mid-request and send malformed requests; engines are SIGKILLed and SIGSTOPped at random;
the store's disk fills up for a while; weights are updated under load. At the end every answered request is
stored with exactly the tokens the engines produced, no engine is left dead, and the manager holds no more
than its memory budget.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from reference.consistency import check_store
from reference.engine.fake import FakeConfig, FakeEngine
from reference.engine.process import EngineProcess, EngineSpec
from reference.manager.embedded import ManagerThread
from reference.manager.manager import ManagerConfig
from reference.manager.store import TrajectoryStore
from reference.manager.supervisor import SupervisorConfig
from reference.model import default_model

MODEL = "seamlessflow-tiny"
SESSIONS = 256
CHAOS_S = 25.0
BUDGET = ManagerConfig(default_max_tokens=12, max_tokens_in_memory=60_000, max_session_tokens_in_memory=2_000,
                       max_in_flight_requests=64)  # fmt: skip
SUPERVISION = SupervisorConfig(interval_s=0.25, probe_timeout_s=1.0, restart_after_s=2.0, max_backoff_s=2.0)
MALFORMED = [b"{", b'{"messages": []}', b'{"messages": [{"role": "user", "content": "a"}], "top_p": NaN}',
             b"[" * 5000]  # fmt: skip


def post(url: str, body: bytes, timeout_s: float) -> tuple[int, dict | None]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class Agents:
    """Sessions run by a pool of threads until told to stop; records what was answered."""

    def __init__(self, m: ManagerThread, seed: int) -> None:
        self.m, self.rng = m, random.Random(seed)
        self.answered: dict[str, list[str]] = {}  # session -> request ids the agent got back
        self.history: dict[str, list[dict]] = {}  # session -> the conversation so far (up to 4 turns)
        self.walked_away = self.malformed = self.retried = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def run(self, worker: int, sessions: list[str]) -> None:
        rng = random.Random(worker)
        while not self.stop.is_set():
            for sid in sessions:
                if self.stop.is_set():
                    return
                self.turn(sid, rng)

    def turn(self, sid: str, rng: random.Random) -> None:
        url = f"{self.m.base_url(sid)}/chat/completions"
        if rng.random() < 0.05:
            status, _ = post(url, rng.choice(MALFORMED), 30)
            with self.lock:
                self.malformed += 1
            if status not in (400, 429):  # 429: shed before its body was read, as any request may be
                self.errors.append(f"malformed request got {status}")
            return
        history = self.history.get(sid) or [{"role": "user", "content": f"{sid} {rng.random()}"}]
        body = json.dumps({"model": MODEL, "messages": history})
        if rng.random() < 0.1:  # walks away before the answer
            try:
                post(url, body.encode(), timeout_s=0.005)
            except (TimeoutError, urllib.error.URLError):
                pass
            with self.lock:
                self.walked_away += 1
            return
        for _ in range(40):
            try:
                status, reply = post(url, body.encode(), timeout_s=60)
            except (TimeoutError, urllib.error.URLError) as e:
                self.errors.append(f"{sid}: {e!r}")
                return
            if status == 200:
                with self.lock:
                    self.answered.setdefault(sid, []).append(reply["trajectory"]["request_id"])
                follow = [reply["choices"][0]["message"], {"role": "user", "content": f"tool output {rng.random()}"}]
                self.history[sid] = [*history, *follow] if len(history) < 7 else []
                return
            if status not in (429, 503):
                self.errors.append(f"{sid}: {status} {reply}")
                return
            with self.lock:
                self.retried += 1
            time.sleep(0.1)
        self.errors.append(f"{sid}: no answer after 40 tries")


def chaos(m: ManagerThread, procs: list[EngineProcess], store: TrajectoryStore, seed: int, log: list[str]) -> None:
    rng, version, deadline = random.Random(seed), 0, time.monotonic() + CHAOS_S
    disk_full_at = time.monotonic() + CHAOS_S / 2
    # The disk fills once, at half time, or last of all if a slow action ran past the deadline meanwhile.
    while time.monotonic() < deadline or disk_full_at < float("inf"):
        time.sleep(rng.uniform(0.5, 1.5))
        action = rng.choice(["kill", "stop", "update", "update"])
        if time.monotonic() > disk_full_at:
            store.set_max_bytes(1)
            time.sleep(0.5)
            store.set_max_bytes(None)
            disk_full_at, action = float("inf"), "disk full for 0.5 s"
        elif action in ("kill", "stop"):
            p = rng.choice(procs)
            if p.alive():
                os.kill(p.pid, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        else:
            version += 1
            m.call(m.manager.pause(), timeout_s=60)
            m.call(m.manager.update_weights(version), timeout_s=60)
            m.call(m.manager.resume(), timeout_s=60)
        log.append(action)


@pytest.mark.slow
def test_soak(tok, tmp_path):
    spec = EngineSpec(backend="fake", heartbeat_s=0.5, options=FakeConfig(token_delay_s=0.004, reply_tokens=10))
    procs = [EngineProcess(spec) for _ in range(3)]
    store = TrajectoryStore(tmp_path / "soak.sqlite", busy_timeout_s=2.0)
    names = {f"e{i}": p for i, p in enumerate(procs)}
    clients = {k: p.client(stall_timeout_s=3.0) for k, p in names.items()}
    actions: list[str] = []
    try:
        with ManagerThread(clients, tok, store, BUDGET, processes=names, supervisor=SUPERVISION) as m:
            agents = Agents(m, seed=0)
            sids = [f"soak-{i}" for i in range(SESSIONS)]
            workers = [threading.Thread(target=agents.run, args=(w, sids[w::32])) for w in range(32)]
            for w in workers:
                w.start()
            try:
                chaos(m, procs, store, seed=1, log=actions)
            finally:
                agents.stop.set()
                for w in workers:
                    w.join(120)
            deadline = time.monotonic() + 60  # the supervisor brings every engine back
            while time.monotonic() < deadline and not all(e["up"] for e in m.call(m.manager.stats())["engines"]):
                time.sleep(0.1)
            stats = m.call(m.manager.stats())
            health = m.manager.health()
            alive = [p.alive() for p in procs]
    finally:
        for p in procs:
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
            p.close()
    assert not agents.errors, agents.errors[:5]
    assert {"kill", "stop", "update", "disk full for 0.5 s"} <= set(actions), actions
    assert all(alive) and all(e["up"] for e in stats["engines"]), stats["engines"]  # no engine left dead
    assert health["status"] == "ok", health
    assert stats["tokens_in_memory"] <= BUDGET.max_tokens_in_memory
    assert agents.walked_away > 0 and agents.malformed > 0 and stats["record_failures"] > 0
    with TrajectoryStore(tmp_path / "soak.sqlite") as check:
        stored = {sid: {r.request_id: r for r in check.records(sid)} for sid in check.sessions()}
        trees = {sid: check.load_tree(sid) for sid in stored}
        sample = sorted(stored)[::8]  # re-scoring every branch with the model takes minutes; all are checked below
        report = check_store(check, default_model()[0], tok, sample)
    assert report.token_mismatches == 0 and report.requests == sum(len(stored[sid]) for sid in sample)
    answered = sum(len(v) for v in agents.answered.values())
    assert answered > 500
    for sid, request_ids in agents.answered.items():
        assert set(request_ids) <= set(stored[sid]), sid  # every answered request is stored
    vocab = tok.vocab_size
    for sid, records in stored.items():
        for r in records.values():  # exactly what the engines produced, across kills and continuations
            context = list(trees[sid].sequence(r.request_id)[: r.prompt_len])
            for i, (token, version) in enumerate(zip(r.token_ids, r.versions, strict=True)):
                ended = i == len(r.token_ids) - 1 and token in tok.stop_token_ids  # the fake's stop token
                assert ended or token == FakeEngine.next_token(context, version, vocab), (sid, r.request_id, i)
                context.append(token)
