"""The manager's sessions in memory: which are held, how much they hold, and which leave first.

A session (one agent episode) is its trajectory tree and its chat renderer. The durable store is the
truth; memory is a cache of it. A session enters memory when a request of it is accepted (a rejected
request creates nothing) or when it is used again after leaving (it is rebuilt from the store, off the
event loop). It leaves memory, least recently used first, when it is idle and either there are more
than `max_sessions` sessions, or all sessions together hold more than `max_tokens` tokens, or it alone
holds more than `max_session_tokens` (a long episode is then rebuilt from the store at its next turn).
A session with a request in flight (including one whose record is being written) never leaves.

"Tokens held" counts what grows with use: the tree's tokens plus the renderer's cached segments and
remembered completions (each token costs about 17 bytes in the tree and 4 in the renderer), and the prompts
of the session's requests in flight. A session's requests in flight may hold at most `max_session_tokens`
of prompts together: beyond it a new one is refused (`admit_prompt`), so one busy session cannot grow
past its budget while it can never leave; nor does what a busy session holds beyond its budget push the
other sessions out (`evict` counts at most `max_session_tokens` of it).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

from reference.manager.chat import ChatRenderer
from reference.manager.prefix_tree import PrefixTree
from reference.manager.store import TrajectoryStore


@dataclass
class Session:
    tree: PrefixTree
    renderer: ChatRenderer
    in_flight: int = 0  # requests accepted and not yet recorded or abandoned: the session stays in memory
    counted: int = 0  # tokens held, as last added to the table's total
    pending: int = 0  # prompt tokens of its requests in flight

    @property
    def session_id(self) -> str:
        return self.tree.session_id

    @property
    def tokens_held(self) -> int:
        return self.tree.num_tokens + self.renderer.tokens_held + self.pending


@dataclass(frozen=True)
class MemoryBudget:
    max_sessions: int = 10_000
    max_tokens: int = 16_000_000  # all sessions together (about 0.4 GB)
    max_session_tokens: int = 2_000_000  # one idle session above this leaves memory

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_tokens", "max_session_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class SessionTable:
    """Sessions in memory, least recently used first. Touched only from the manager's event loop."""

    def __init__(self, store: TrajectoryStore, tokenizer, budget: MemoryBudget) -> None:
        self.store, self.tok, self.budget = store, tokenizer, budget
        self._live: OrderedDict[str, Session] = OrderedDict()
        self._loading: dict[str, asyncio.Future] = {}
        self.tokens_held = 0  # sum of `counted` over live sessions
        self.excess = 0  # what busy sessions hold beyond max_session_tokens (not counted against the others)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._live

    def ids(self) -> list[str]:
        return list(self._live)

    async def get(self, session_id: str, create: bool) -> Session | None:
        """The session, from memory or rebuilt from the store; with `create`, a new session for an unknown
        id that is NOT yet held (`attach` holds it once its request is accepted); else None."""
        session = self._live.get(session_id)
        if session is not None:
            self._live.move_to_end(session_id)
            return session
        loading = self._loading.get(session_id)
        if loading is None and self.store.probe_session(session_id) is False:  # a new session: no thread needed
            return Session(PrefixTree(session_id), ChatRenderer(self.tok)) if create else None
        if loading is None:
            loading = self._loading[session_id] = asyncio.ensure_future(self._load(session_id))
            loading.add_done_callback(lambda _: self._loading.pop(session_id, None))
        session = await asyncio.shield(loading)
        if session is None:
            return Session(PrefixTree(session_id), ChatRenderer(self.tok)) if create else None
        return self.attach(session, pin=False)

    async def _load(self, session_id: str) -> Session | None:
        return await asyncio.to_thread(self._read, session_id)

    def _read(self, session_id: str) -> Session | None:
        """Rebuild a session from the store (worker thread: the session is private until attached)."""
        if not self.store.has_session(session_id):
            return None
        renderer = ChatRenderer(self.tok)
        for r in self.store.records(session_id):
            renderer.remember(r.text, r.token_ids)
        return Session(self.store.load_tree(session_id), renderer)

    def admit_prompt(self, session: Session, prompt_tokens: int) -> str | None:
        """Why a request of `prompt_tokens` must wait (its session's requests in flight would hold more than
        `max_session_tokens` of prompts), or None. A session with nothing in flight always takes one."""
        held = self._live.get(session.session_id, session).pending
        cap = self.budget.max_session_tokens
        if held and held + prompt_tokens > cap:
            return (
                f"session {session.session_id[:64]!r} has requests in flight holding {held:,} prompt tokens; "
                f"this one's {prompt_tokens:,} would pass the per-session budget of {cap:,}"
            )
        return None

    def attach(self, session: Session, pin: bool = True, prompt_tokens: int = 0) -> Session:
        """Hold `session` in memory (or the one already held under its id, which then wins); with `pin`,
        count a request in flight on it, holding `prompt_tokens` of prompt."""
        held = self._live.get(session.session_id)
        if held is None:
            held = self._live[session.session_id] = session
        else:
            self._live.move_to_end(session.session_id)
        if pin:
            held.in_flight += 1
            held.pending += prompt_tokens
        self.update(held)
        return held

    def release(self, session: Session, prompt_tokens: int = 0) -> None:
        """A request of `session` holding `prompt_tokens` of prompt ended (recorded or abandoned): update the
        accounting and evict."""
        session.in_flight -= 1
        session.pending -= prompt_tokens
        if self._live.get(session.session_id) is not session:
            return
        if session.in_flight == 0 and not session.tree.request_ids():
            self._drop(session.session_id)  # nothing recorded: the session never existed
            return
        self.update(session)
        if session.in_flight == 0 and session.counted > self.budget.max_session_tokens:
            self._drop(session.session_id)
        self.evict()

    def update(self, session: Session) -> None:
        """Bring the table's total up to date with what `session` holds now."""
        held, cap = session.tokens_held, self.budget.max_session_tokens
        self.tokens_held += held - session.counted
        self.excess += max(0, held - cap) - max(0, session.counted - cap)
        session.counted = held

    def evict(self) -> None:
        """Drop idle sessions, least recently used first, while over the session count or token budget."""
        b = self.budget
        count, tokens = len(self._live), self.tokens_held - self.excess
        victims = []
        for sid, s in self._live.items():  # stops as soon as enough is found: O(evicted), not O(sessions)
            if count <= b.max_sessions and tokens <= b.max_tokens:
                break
            if s.in_flight == 0:
                victims.append(sid)
                count, tokens = count - 1, tokens - min(s.counted, b.max_session_tokens)
        for sid in victims:
            self._drop(sid)

    def _drop(self, session_id: str) -> None:
        session = self._live.pop(session_id)
        self.tokens_held -= session.counted
        self.excess -= max(0, session.counted - self.budget.max_session_tokens)
        session.counted = 0
        self.evictions += 1
