"""The trajectory manager's core: sessions, their trajectories and annotations, and the manager's health.

Each session owns a prefix tree (its trajectory) and a chat renderer (which splices the session's own
completions back in as the exact ids the engine sampled); `sessions.py` holds them in memory within a
budget. A request is recorded only when it finishes: durably first, then in the tree (`recorder.py`),
and only then does the agent get its answer, so whatever an agent saw survives a manager restart and a
failed write leaves nothing behind (the agent gets a 503; the session goes on from what is stored).

The manager's other parts are its base classes, so callers see one object: `admission.py` (what is refused
before anything is spent: 429s as the event loop lags, 400s for prompts that cannot fit), `generation.py`
(a request's tokens, continued on another engine when one fails, then recorded) and `fleet.py` (partial
rollout and placement: pause, weights, resume, preemption, and the watchdog that ends a forgotten pause).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

from reference.engine.base import InferenceEngine
from reference.manager.admission import Admission
from reference.manager.annotations import check_annotations, readable
from reference.manager.chat import RequestError
from reference.manager.config import ManagerConfig
from reference.manager.errors import StoreError, store_unavailable
from reference.manager.fleet import FleetControl
from reference.manager.generation import Generation, Progress
from reference.manager.load import AdaptiveLimit, LoopLag
from reference.manager.recorder import Recorder
from reference.manager.router import Router
from reference.manager.sessions import Session, SessionTable
from reference.manager.store import TrajectoryStore
from reference.manager.supervisor import EngineHandle, Supervisor, SupervisorConfig

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.match(session_id):
        raise RequestError(
            f"session id {session_id[:140]!r} must be 1-128 characters of letters, digits and ._:-",
            param="session_id",
            code="invalid_session_id",
        )
    return session_id


class TrajectoryManager(Admission, Generation, FleetControl):
    """Sessions, their trajectories and annotations, and observability; admission (`admission.py`), generation
    (`generation.py`) and the engines' control (`fleet.py`) are its base classes."""

    def __init__(
        self,
        engines: dict[str, InferenceEngine],
        tokenizer,
        store: TrajectoryStore,
        config: ManagerConfig | None = None,
        max_context: int | None = None,
        processes: dict[str, EngineHandle] | None = None,
        supervisor: SupervisorConfig | None = None,
    ) -> None:
        """`processes`: the engine processes this manager may restart, by engine name (see supervisor.py)."""
        self.engines, self.tok, self.store = engines, tokenizer, store
        self.config = config = config or ManagerConfig()
        self.router = Router(engines, config.affinity_slack, config.engine_cooldown_s, config.engine_max_cooldown_s)
        self.sessions = SessionTable(store, tokenizer, config.budget())
        self.recorder = Recorder(store, config.durable_within_s)
        self.max_context = max_context
        self.in_flight = 0
        self.arriving = 0  # agent requests parsed, their handlers not yet started (the server's connections keep it)
        self.body_bytes = 0  # request bodies being read, parsed or tokenised (max_body_bytes_in_flight)
        self.shed = 0  # requests answered 429
        self.shed_on_arrival = 0  # of those, refused from the connection before a request object existed
        # Bodies over a MiB are parsed and tokenised one at a time in a thread of their own, the rest over 64 KiB in
        # two more: neither holds the threads session reloads and the store use, nor do many huge ones share memory.
        self.body_threads = {
            "large": ThreadPoolExecutor(2, thread_name_prefix="manager-body"),
            "huge": ThreadPoolExecutor(1, thread_name_prefix="manager-huge-body"),
        }
        self.watchdog_resumes = 0
        self._watchdogs: set[asyncio.Task] = set()
        self._migrating: set[str] = set()  # engine request ids aborted by `preempt`, to continue elsewhere
        self._restarting: set[str] = set()  # engine request ids aborted to start over from their prompt
        self._progress: dict[str, Progress] = {}  # engine request id -> its request's progress
        # Request ids: a random prefix per manager process and a counter (uuid4 per request costs a syscall).
        self._request_prefix, self._request_numbers = secrets.token_hex(6), itertools.count()
        self._serving_changed = asyncio.Event()
        self.control = asyncio.Lock()  # serialises fleet state changes (pause, weights, resume, engine syncs)
        self._stop_ids = (tokenizer.im_end_id, tokenizer.eos_token_id)
        self.supervisor = Supervisor(self, processes, supervisor)
        self.connections = 0  # open HTTP connections (the server keeps it; `health` reports the cap reached)
        self.max_connections: int | None = None  # what the open-file limit leaves (`start_manager_server`)
        self.connections_closed = 0  # idle connections closed to make room for new ones
        self.admission = AdaptiveLimit(config.max_in_flight_requests, config.max_loop_lag_s)
        self.loop_lag = LoopLag(on_sample=lambda lag: self.admission.update(lag, self.in_flight))

    async def start(self) -> None:
        """Learn the context length and policy version from the engines that answer (at least one must)."""
        stats = await asyncio.gather(*(e.stats() for e in self.engines.values()), return_exceptions=True)
        up = [s for s in stats if not isinstance(s, BaseException)]
        if not up:
            raise RuntimeError(f"no engine answered at start-up: {stats[0]}")
        if self.max_context is None:
            self.max_context = min(s.max_context for s in up)
        newest = max(s.version for s in up)
        for slot in self.router.slots:
            slot.version = newest  # an engine behind is brought to it by the supervisor
        for slot, s in zip(self.router.slots, stats, strict=True):
            if isinstance(s, BaseException):
                self.router.hold_down(slot, f"no answer at start-up: {s}")
                slot.stale = True
        await asyncio.to_thread(lambda: self.tok.max_token_chars)  # (decodes the whole vocabulary once)
        self.supervisor.start()
        self.loop_lag.start()

    async def close(self) -> None:
        for task in list(self._watchdogs):
            task.cancel()
        await self.supervisor.close()
        await self.loop_lag.close()
        await asyncio.to_thread(self.recorder.close)
        for pool in self.body_threads.values():
            pool.shutdown(wait=False, cancel_futures=True)

    # ---- sessions ----

    async def session(self, session_id: str, create: bool = True) -> Session | None:
        """The session (from memory or the store); with `create`, a new one for an unknown id, held in
        memory only once a request of it is accepted (`accepted`)."""
        try:
            return await self.sessions.get(check_session_id(session_id), create)
        except StoreError as e:  # rebuilding it from the store needs the journal folded, and that failed
            raise store_unavailable(e) from None

    def accepted(self, session: Session, fresh_segments: dict | None = None, prompt_tokens: int = 0) -> _Held:
        """Hold `session` in memory for an accepted request of `prompt_tokens` (and cache the segments its prompt
        needed), until the `with` block this is used in ends: `with manager.accepted(session) as session: ...`.
        A 429 when the session's requests in flight would hold more than its budget (`SessionTable.admit_prompt`)."""
        if (why := self.sessions.admit_prompt(session, prompt_tokens)) is not None:
            self._shed(f"{why}; retry when some have finished")
        held = self.sessions.attach(session, prompt_tokens=prompt_tokens)
        if fresh_segments:
            held.renderer.commit(fresh_segments)
        return _Held(self.sessions, held, prompt_tokens)

    async def session_ids(self) -> list[str]:
        try:
            stored = await asyncio.to_thread(self.store.sessions)
        except StoreError as e:
            raise store_unavailable(e, wrote=False) from None
        return sorted(set(self.sessions.ids()) | set(stored))

    async def trajectory(self, session_id: str) -> dict | None:
        """The session's stored tree as JSON, with its annotations and their history; each branch gets its
        `reward` (the branch's own if one was set, else the session's, else null). Built from the store in
        a worker thread, so a huge tree never stalls the event loop."""
        try:
            return await asyncio.to_thread(self._trajectory, check_session_id(session_id))
        except StoreError as e:
            raise store_unavailable(e, wrote=False) from None

    def _trajectory(self, session_id: str) -> dict | None:
        if not self.store.has_session(session_id):
            return None
        tree = self.store.load_tree(session_id).to_json()
        notes = self.store.annotations(session_id)
        tree["annotations"] = notes
        tree["annotation_history"] = self.store.annotation_history(session_id)
        branch_rewards = notes.get("branch_rewards", {})
        for branch in tree["branches"]:
            branch["reward"] = branch_rewards.get(str(branch["branch_id"]), notes.get("reward"))
        return tree

    async def annotate(self, session_id: str, body, author: str) -> dict:
        """Attach a reward (for the session or per branch), a task id or metadata to a session; every write
        is kept in the session's annotation history with its author."""
        updates, claimed = check_annotations(body)
        check_session_id(session_id)
        try:
            stored = await asyncio.to_thread(self.store.has_session, session_id)
        except StoreError as e:
            raise store_unavailable(e) from None
        if not stored:
            raise RequestError(
                f"no finished request in session {session_id!r} to annotate", status=404, code="session_not_found"
            )
        who = readable(f"{claimed} ({author})" if claimed else author)  # a header's or a body's bad bytes: not a 500
        try:
            return await asyncio.to_thread(self.store.annotate, session_id, updates, who)
        except StoreError as e:
            raise store_unavailable(e) from None

    # ---- generation ----

    # ---- observability ----

    def health(self) -> dict:
        """{"ok", "status": ok | degraded | unhealthy, "reasons": [...]}: unhealthy when no engine is up or
        the store cannot write; degraded when some engine is down or a pause has lasted over a minute."""
        reasons, status = [], "ok"
        if (problem := self.recorder.problem()) is not None:
            reasons.append(f"store: {problem}")
            status = "unhealthy"
        engines = self.router.stats()
        down = [e for e in engines if not e["up"]]
        if len(down) == len(engines):
            reasons.append("no engine is up")
            status = "unhealthy"
        elif down and status == "ok":
            status = "degraded"
        reasons += [f"engine {e['name']} is down: {e['reason']}" for e in down]
        now = time.monotonic()
        if long := [s.name for s in self.router.slots if s.paused_since is not None and now - s.paused_since > 60]:
            reasons.append(f"engines paused for over a minute: {', '.join(long)}")
            status = "degraded" if status == "ok" else status
        saturated = []
        if self.in_flight >= self.admission.limit:
            saturated.append(f"{self.in_flight} requests in flight at a limit of {self.admission.limit}")
        if self.max_connections is not None and self.connections >= self.max_connections:
            saturated.append(f"{self.connections} connections open at a limit of {self.max_connections}")
        if saturated:  # agents get 429s or lose idle connections: the server works but sheds
            reasons.append("admission saturated: " + "; ".join(saturated))
            status = "degraded" if status == "ok" else status
        return {"ok": status != "unhealthy", "status": status, "reasons": reasons}

    async def stats(self) -> dict:
        return {
            "version": self.version,
            "max_context": self.max_context,
            "paused": self.paused,
            "in_flight": self.in_flight,
            "arriving": self.arriving,
            "shed": self.shed,
            "shed_on_arrival": self.shed_on_arrival,
            "admission_limit": self.admission.limit,
            "loop_lag_ms": round(self.loop_lag.lag_s * 1e3, 1),
            "max_loop_lag_ms": round(self.loop_lag.max_lag_s * 1e3, 1),
            "sessions_in_memory": len(self.sessions),
            "tokens_in_memory": self.sessions.tokens_held,
            "evictions": self.sessions.evictions,
            "recorded": self.recorder.committed,
            "record_failures": self.recorder.failed,
            "records_journaled": self.recorder.journaled,  # of "recorded", those the event loop journaled
            "records_unfolded": self.store.unfolded,  # journaled, not yet in SQLite (other processes see them later)
            "watchdog_resumes": self.watchdog_resumes,
            "engines": self.router.stats(),
        }


class _Held:
    """The context manager of `TrajectoryManager.accepted` (a class: it runs on every request)."""

    __slots__ = ("table", "session", "prompt_tokens")

    def __init__(self, table: SessionTable, session: Session, prompt_tokens: int = 0) -> None:
        self.table, self.session, self.prompt_tokens = table, session, prompt_tokens

    def __enter__(self) -> Session:
        return self.session

    def __exit__(self, *exc: object) -> None:
        self.table.release(self.session, self.prompt_tokens)
