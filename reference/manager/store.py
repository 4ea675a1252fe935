"""Durable, append-only storage of finished requests (SQLite in WAL mode) and replay into prefix trees.

Each finished request is one `TurnRecord`: only what it added (prompt[match_len:] and its generated tokens)
plus the anchor request whose sequence supplies prompt[:match_len]. An append therefore costs O(new
tokens) however long the session is, and `load_tree` rebuilds a session's tree by replaying its records in
order. The manager passes the `InsertResult` of `PrefixTree.insert` straight through:
`append(..., result.anchor_request_id, result.match_len, prompt[result.match_len:], ...)`.

Durability: WAL with synchronous=NORMAL, so a committed append survives the process being killed (power
loss may lose the last commits since the last checkpoint). Token arrays are stored as little-endian blobs
(uint32 ids, float64 logprobs, int32 versions), not JSON. Connections, each used by one thread at a
time under its own lock: one writes, one reads (WAL readers never wait for the writer), and for a file
store one more writes without waiting (`append_many(..., wait=False)`: it never waits for a lock,
never checkpoints the log, and gives up at once when another writer holds the lock, so the manager's
event loop can commit a small record itself; `checkpoint` then folds the log into the database from a
worker thread). Every other call comes from worker threads (`asyncio.to_thread`).

Failures are explicit: a write that SQLite cannot complete (disk full, another process holding the write
lock past `busy_timeout_s`) raises `StoreError` and leaves nothing half-written; before every write the
store checks that its files are still the ones it opened, so a store deleted or replaced while serving is
reported at once instead of silently losing everything at the next restart.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference.manager.prefix_tree import PrefixTree

FORMAT = "seamlessflow-trajectory-store"
SCHEMA_VERSION = 1
_SCHEMA = (
    "CREATE TABLE schema_version (format TEXT NOT NULL, version INTEGER NOT NULL)",
    "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, created_s REAL NOT NULL)",
    """CREATE TABLE turns (
        session_id TEXT NOT NULL REFERENCES sessions (session_id),
        seq INTEGER NOT NULL,
        request_id TEXT NOT NULL,
        anchor_request_id TEXT,
        match_len INTEGER NOT NULL,
        num_tokens INTEGER NOT NULL,  -- prompt + generated: bounds the match_len of later anchored turns
        new_prompt_token_ids BLOB NOT NULL,  -- uint32 little-endian
        token_ids BLOB NOT NULL,  -- uint32 little-endian
        logprobs BLOB NOT NULL,  -- float64 little-endian
        versions BLOB NOT NULL,  -- int32 little-endian
        finish_reason TEXT NOT NULL,
        text TEXT NOT NULL,
        created_s REAL NOT NULL,
        meta TEXT NOT NULL,  -- JSON object
        PRIMARY KEY (session_id, seq),
        UNIQUE (session_id, request_id)
    )""",
)
# Tables added since schema version 1 (created when missing, so older stores open unchanged).
_ADDITIVE = (
    """CREATE TABLE IF NOT EXISTS annotations (
        session_id TEXT PRIMARY KEY,
        data TEXT NOT NULL,  -- JSON object: reward, branch_rewards, task_id, meta
        updated_s REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS annotation_history (
        session_id TEXT NOT NULL,
        at_s REAL NOT NULL,
        author TEXT NOT NULL,  -- who wrote it: the caller's address and what it said about itself
        updates TEXT NOT NULL  -- JSON object: the fields this write set
    )""",
    "CREATE INDEX IF NOT EXISTS annotation_history_session ON annotation_history (session_id)",
    """CREATE TABLE IF NOT EXISTS consumed (
        item TEXT PRIMARY KEY,  -- what a training step consumed (a rollout group's key)
        step INTEGER NOT NULL,  -- the step that consumed it
        at_s REAL NOT NULL
    )""",
)
_COLUMNS = (
    "session_id, seq, request_id, anchor_request_id, match_len, num_tokens, new_prompt_token_ids, token_ids, "
    "logprobs, versions, finish_reason, text, created_s, meta"
)


class StoreError(RuntimeError):
    """The durable store cannot take a write (disk full, locked too long, its files removed or replaced)."""


class _GiveWay(Exception):
    """A write that may not wait found another writer holding the lock; nothing was written."""


@dataclass(frozen=True)
class NewTurn:
    """A finished request to store: the contract between the manager and the store. The request's prompt is
    sequence(anchor_request_id)[:match_len] + new_prompt_token_ids (see `PrefixTree.plan`)."""

    session_id: str
    request_id: str
    anchor_request_id: str | None
    match_len: int
    new_prompt_token_ids: Sequence[int]
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    finish_reason: str
    text: str
    meta: dict[str, Any] | None = None


@dataclass(frozen=True)
class TurnRecord:
    """One finished request, as stored. seq is its position in the session (0, 1, ...), assigned by the
    store; the request's prompt is sequence(anchor_request_id)[:match_len] + new_prompt_token_ids."""

    session_id: str
    request_id: str
    seq: int
    anchor_request_id: str | None
    match_len: int
    new_prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str
    text: str
    created_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return self.match_len + len(self.new_prompt_token_ids)


def _pack(name: str, typecode: str, values: Sequence[int] | Sequence[float]) -> bytes:
    """Values as a little-endian blob of `typecode` items."""
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    try:
        arr = values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"{name} does not fit array type {typecode!r}: {e}") from None
    if sys.byteorder == "big":
        arr = array(typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def _unpack(typecode: str, blob: bytes) -> array:
    arr = array(typecode)
    arr.frombytes(blob)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr


def _check_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str, got {value!r}")


def _prepare(turn: NewTurn) -> tuple:
    """Validate one record and pack its arrays (no database access)."""
    session_id, request_id, anchor_request_id, match_len = (
        turn.session_id, turn.request_id, turn.anchor_request_id, turn.match_len)  # fmt: skip
    new_prompt_token_ids, token_ids, logprobs, versions = (
        turn.new_prompt_token_ids, turn.token_ids, turn.logprobs, turn.versions)  # fmt: skip
    finish_reason, text, meta = turn.finish_reason, turn.text, turn.meta
    _check_name("session_id", session_id)
    _check_name("request_id", request_id)
    if not isinstance(match_len, int) or match_len < 0:
        raise ValueError(f"match_len must be an int >= 0, got {match_len!r}")
    if (anchor_request_id is None) != (match_len == 0):
        raise ValueError(f"anchor_request_id {anchor_request_id!r} must be None exactly when match_len == 0")
    if match_len + len(new_prompt_token_ids) == 0:
        raise ValueError("the prompt is empty: match_len == 0 and no new_prompt_token_ids")
    if not len(token_ids) == len(logprobs) == len(versions):
        n = (len(token_ids), len(logprobs), len(versions))
        raise ValueError(f"token_ids, logprobs and versions differ in length: {n}")
    if not isinstance(finish_reason, str) or not isinstance(text, str):
        raise ValueError(f"finish_reason and text must be str, got {finish_reason!r} and {type(text).__name__}")
    try:
        meta_json = json.dumps({} if meta is None else meta, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be a JSON-serialisable dict: {e}") from None
    blobs = (
        _pack("new_prompt_token_ids", "I", new_prompt_token_ids),
        _pack("token_ids", "I", token_ids),
        _pack("logprobs", "d", logprobs),
        _pack("versions", "i", versions),
    )
    num_tokens = match_len + len(new_prompt_token_ids) + len(token_ids)
    return session_id, request_id, anchor_request_id, match_len, num_tokens, blobs, (
        finish_reason, text, time.time(), meta_json)  # fmt: skip


class TrajectoryStore:
    """Append-only SQLite store of `TurnRecord`s; ':memory:' keeps it in memory (tests).

    `busy_timeout_s`: how long a write waits for another process's write lock before failing with
    `StoreError` (reads never wait for writers in WAL mode). `max_bytes`: a cap on the database's size."""

    def __init__(self, path: str | Path, busy_timeout_s: float = 10.0, max_bytes: int | None = None) -> None:
        self.path = str(path)
        self.memory = self.path == ":memory:"
        if not self.memory:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._now: sqlite3.Connection | None = None  # writes that never wait (None: in memory)
        try:
            self._conn = self._connect(busy_timeout_s)
        except sqlite3.Error as e:
            raise ValueError(f"cannot open a trajectory store at {self.path}: {e}") from None
        try:
            self._open()
            self._read, self._read_lock = self._conn, self._lock
            self._probe: sqlite3.Connection | None = None
            self._probe_lock = threading.Lock()
            self._now_lock = threading.Lock()
            if not self.memory:
                self._read, self._read_lock = self._connect(5.0), threading.Lock()
                self._now = self._connect(0.0)
                self._now.execute("PRAGMA synchronous=NORMAL")
                self._now.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints run in `checkpoint`, off the loop
        except sqlite3.DatabaseError as e:
            self._conn.close()
            raise ValueError(f"{self.path} is not a trajectory store: {e}") from None
        except BaseException:
            self._conn.close()
            raise
        self._identity = self._file_identity()
        if max_bytes is not None:
            self.set_max_bytes(max_bytes)

    def set_max_bytes(self, max_bytes: int | None) -> None:
        """Cap the database's size (a write past it fails like a full disk: StoreError); None lifts the cap."""
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
        with self._lock:
            page = self._conn.execute("PRAGMA page_size").fetchone()[0]
            pages = (max_bytes + page - 1) // page if max_bytes is not None else 2**31 - 2
            self._conn.execute(f"PRAGMA max_page_count = {int(pages)}")
        if self._now is not None:
            with self._now_lock:
                self._now.execute(f"PRAGMA max_page_count = {int(pages)}")

    def _connect(self, timeout_s: float) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None, check_same_thread=False)

    def _file_identity(self) -> dict[str, tuple[int, int]]:
        """(device, inode) of the database file and its write-ahead log, as opened."""
        if self.memory:
            return {}
        found = {}
        for name in (self.path, self.path + "-wal"):
            try:
                st = os.stat(name)
            except FileNotFoundError:
                continue
            found[name] = (st.st_dev, st.st_ino)
        return found

    def problem(self) -> str | None:
        """Why the store cannot be trusted with writes any more (its files removed or replaced), or None."""
        for name, identity in self._identity.items():
            try:
                st = os.stat(name)
            except FileNotFoundError:
                return f"the trajectory store file {name} was removed while the manager was running"
            if (st.st_dev, st.st_ino) != identity:
                return f"the trajectory store file {name} was replaced while the manager was running"
        return None

    def _open(self) -> None:
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        with self._transaction():
            tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                for statement in (*_SCHEMA, *_ADDITIVE):
                    self._conn.execute(statement)
                self._conn.execute("INSERT INTO schema_version VALUES (?, ?)", (FORMAT, SCHEMA_VERSION))
                return
            found = self._conn.execute("SELECT format, version FROM schema_version").fetchall()
            if found != [(FORMAT, SCHEMA_VERSION)]:
                raise ValueError(
                    f"{self.path} is not a {FORMAT} of schema version {SCHEMA_VERSION}: schema_version holds {found}"
                )
            for statement in _ADDITIVE:
                self._conn.execute(statement)

    @contextmanager
    def _transaction(self, conn: sqlite3.Connection | None = None) -> Iterator[None]:
        """A write transaction on `conn` (the writing connection by default); on the connection that never
        waits, another writer holding the lock raises `_GiveWay` before anything is written."""
        conn = self._conn if conn is None else conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            if conn is self._now and getattr(e, "sqlite_errorcode", 0) & 0xFF in (
                sqlite3.SQLITE_BUSY,
                sqlite3.SQLITE_LOCKED,
            ):
                raise _GiveWay from None
            raise
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite may already have rolled back (e.g. disk full)
                conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _writing(self, what: str, conn: sqlite3.Connection | None = None) -> Iterator[None]:
        """A write transaction under the write lock (on `conn`: under the lock its caller holds); SQLite
        failures and a missing file become StoreError."""
        with self._lock if conn is None else nullcontext():
            if (problem := self.problem()) is not None:
                raise StoreError(f"{problem}; refusing to {what} (restart the manager to open a store)")
            try:
                with self._transaction(conn):
                    yield
            except sqlite3.Error as e:
                raise StoreError(f"the trajectory store {self.path} could not {what}: {e}") from e
        if len(self._identity) < 2:  # the write-ahead log appears with the first write
            self._identity = self._file_identity()

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        if self._read is not self._conn:
            with self._read_lock:
                self._read.close()
        if self._probe is not None and self._probe is not self._conn:
            with self._probe_lock:
                self._probe.close()
        if self._now is not None:
            with self._now_lock:
                self._now.close()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(
        self,
        session_id: str,
        request_id: str,
        anchor_request_id: str | None,
        match_len: int,
        new_prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        finish_reason: str,
        text: str,
        meta: dict[str, Any] | None = None,
    ) -> TurnRecord:
        """Store one finished request in one transaction; assigns its seq and created_s."""
        turn = NewTurn(session_id, request_id, anchor_request_id, match_len, new_prompt_token_ids, token_ids,
                       logprobs, versions, finish_reason, text, meta)  # fmt: skip
        return _record(self._append([turn])[0])

    def append_many(self, turns: Sequence[NewTurn], wait: bool = True) -> list[int] | None:
        """Store several finished requests, in order, in ONE transaction: all or none; returns their seqs.
        A busy manager commits the requests that finished together at once. ValueError for a malformed
        or inconsistent record; StoreError when the store cannot write. With `wait=False` nothing waits:
        None (nothing written) when another writer holds the lock, or for a store in memory."""
        if wait:
            return [row[1] for row in self._append(turns)]
        if self._now is None or not self._now_lock.acquire(blocking=False):
            return None
        try:
            rows = self._append_now(turns)
        finally:
            self._now_lock.release()
        return None if rows is None else [row[1] for row in rows]

    def _append(self, turns: Sequence[NewTurn]) -> list[tuple]:
        prepared = [_prepare(t) for t in turns]
        with self._writing("store a finished request"):
            return self._insert(self._conn, prepared)

    def _append_now(self, turns: Sequence[NewTurn]) -> list[tuple] | None:
        """`_append` on the connection that never waits (its lock held): None when another writer holds
        the database's lock."""
        prepared = [_prepare(t) for t in turns]
        try:
            with self._writing("store a finished request", self._now):
                return self._insert(self._now, prepared)
        except _GiveWay:
            return None

    def _insert(self, conn: sqlite3.Connection, prepared: list[tuple]) -> list[tuple]:
        """The rows of prepared records, inserted inside the caller's transaction on `conn`."""
        rows = []
        for session_id, request_id, anchor, match_len, num_tokens, blobs, tail in prepared:
            self._check_anchor(session_id, anchor, match_len, conn)
            seq = conn.execute("SELECT MAX(seq) FROM turns WHERE session_id = ?", (session_id,)).fetchone()[0]
            if seq is None:
                conn.execute("INSERT OR IGNORE INTO sessions VALUES (?, ?)", (session_id, tail[2]))
            seq = 0 if seq is None else seq + 1
            row = (session_id, seq, request_id, anchor, match_len, num_tokens, *blobs, *tail)
            try:
                conn.execute(f"INSERT INTO turns ({_COLUMNS}) VALUES ({', '.join('?' * 14)})", row)
            except sqlite3.IntegrityError:  # UNIQUE (session_id, request_id)
                raise ValueError(f"request_id {request_id!r} is already stored in session {session_id!r}") from None
            rows.append(row)
        return rows

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the database as far as readers allow (never waiting for them);
        from a worker thread: the writes that never wait leave this to be done here."""
        with self._lock:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error as e:
                raise StoreError(f"the trajectory store {self.path} could not checkpoint its log: {e}") from e

    def _check_anchor(
        self, session_id: str, anchor_request_id: str | None, match_len: int, conn: sqlite3.Connection | None = None
    ) -> None:
        if anchor_request_id is None:
            return
        query = "SELECT num_tokens FROM turns WHERE session_id = ? AND request_id = ?"
        found = (self._conn if conn is None else conn).execute(query, (session_id, anchor_request_id)).fetchone()
        if found is None:
            raise ValueError(f"anchor_request_id {anchor_request_id!r} is not stored in session {session_id!r}")
        if match_len > found[0]:
            raise ValueError(
                f"match_len {match_len} is longer than anchor {anchor_request_id!r}'s sequence ({found[0]} tokens)"
            )

    def annotate(self, session_id: str, updates: dict[str, Any], author: str = "") -> dict[str, Any]:
        """Merge `updates` into the session's annotations (dict values are merged key by key, others
        replaced) and append them to the session's annotation history, in one transaction; returns the
        merged annotations."""
        _check_name("session_id", session_id)
        now = time.time()
        with self._writing("annotate a session"):
            self._conn.execute(
                "INSERT INTO annotation_history VALUES (?, ?, ?, ?)",
                (session_id, now, author, json.dumps(updates, sort_keys=True, allow_nan=False)),
            )
            row = self._conn.execute("SELECT data FROM annotations WHERE session_id = ?", (session_id,)).fetchone()
            merged = json.loads(row[0]) if row else {}
            for key, value in updates.items():
                old = merged.get(key)
                merged[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
            data = json.dumps(merged, sort_keys=True, allow_nan=False)
            self._conn.execute(
                "INSERT INTO annotations VALUES (?, ?, ?) ON CONFLICT (session_id) DO UPDATE SET "
                "data = excluded.data, updated_s = excluded.updated_s",
                (session_id, data, now),
            )
        return merged

    def annotations(self, session_id: str) -> dict[str, Any]:
        """The session's annotations ({} if none)."""
        with self._read_lock:
            row = self._read.execute("SELECT data FROM annotations WHERE session_id = ?", (session_id,)).fetchone()
        return json.loads(row[0]) if row else {}

    def annotation_history(self, session_id: str) -> list[dict[str, Any]]:
        """Every annotation write to the session, oldest first: {"at_s", "author", "updates"}."""
        with self._read_lock:
            rows = self._read.execute(
                "SELECT at_s, author, updates FROM annotation_history WHERE session_id = ? ORDER BY rowid",
                (session_id,),
            ).fetchall()
        return [{"at_s": at, "author": author, "updates": json.loads(u)} for at, author, u in rows]

    def records(self, session_id: str) -> list[TurnRecord]:
        """The session's records in seq order; [] for an unknown session."""
        with self._read_lock:
            rows = self._read.execute(
                f"SELECT {_COLUMNS} FROM turns WHERE session_id = ? ORDER BY seq", (session_id,)
            ).fetchall()
        return [_record(row) for row in rows]

    def sessions(self) -> list[str]:
        """Every session id, in the order of their first record."""
        with self._read_lock:
            return [r[0] for r in self._read.execute("SELECT session_id FROM sessions ORDER BY rowid")]

    def probe_session(self, session_id: str) -> bool | None:
        """Whether the session is stored, if that can be told at once: a primary-key lookup on a connection of
        its own that never waits (None when it would: another process holds the database, or another
        thread is using the connection). For an event loop, where `has_session` could block."""
        lock = self._lock if self.memory else self._probe_lock
        if not lock.acquire(blocking=False):
            return None
        try:
            if self._probe is None:
                self._probe = self._conn if self.memory else self._connect(0.0)
            query = "SELECT 1 FROM sessions WHERE session_id = ?"
            return self._probe.execute(query, (session_id,)).fetchone() is not None
        except sqlite3.Error:
            return None
        finally:
            lock.release()

    # ---- consumed-markers: what training used, exactly once ----

    def mark_consumed(self, items: Sequence[str], step: int) -> None:
        """Record, in one transaction, that training step `step` consumed `items` (rollout groups' keys).
        ValueError (and nothing recorded) if one was already consumed: no group is trained twice."""
        items = list(items)
        for item in items:
            _check_name("item", item)
        if len(set(items)) != len(items):
            raise ValueError(f"items to mark consumed repeat: {sorted(items)}")
        if not items:
            return
        with self._writing("mark consumed items"):
            rows = self._conn.execute(
                f"SELECT item, step FROM consumed WHERE item IN ({', '.join('?' * len(items))})", items
            ).fetchall()
            if rows:
                raise ValueError(f"{rows[0][0]!r} was already consumed by step {rows[0][1]}")
            now = time.time()
            self._conn.executemany("INSERT INTO consumed VALUES (?, ?, ?)", [(i, step, now) for i in items])

    def consumed(self) -> dict[str, int]:
        """Every consumed item and the step that consumed it."""
        with self._read_lock:
            return dict(self._read.execute("SELECT item, step FROM consumed").fetchall())

    def release_consumed(self, from_step: int) -> list[str]:
        """Forget what steps >= `from_step` consumed (a trainer resumed from the checkpoint before them will
        train on it again); returns the items released."""
        with self._writing("release consumed items"):
            rows = self._conn.execute("SELECT item FROM consumed WHERE step >= ?", (from_step,)).fetchall()
            self._conn.execute("DELETE FROM consumed WHERE step >= ?", (from_step,))
        return sorted(r[0] for r in rows)

    def has_session(self, session_id: str) -> bool:
        with self._read_lock:
            query = "SELECT 1 FROM sessions WHERE session_id = ?"
            return self._read.execute(query, (session_id,)).fetchone() is not None

    def load_tree(self, session_id: str) -> PrefixTree:
        """Rebuild the session's tree by replaying its records in order (KeyError for an unknown session)."""
        with self._read_lock:
            rows = self._read.execute(
                "SELECT request_id, anchor_request_id, match_len, new_prompt_token_ids, token_ids, logprobs, "
                "versions FROM turns WHERE session_id = ? ORDER BY seq",
                (session_id,),
            ).fetchall()
        if not rows:
            raise KeyError(f"no session {session_id!r} in {self.path}")
        tree = PrefixTree(session_id)
        for request_id, anchor, match_len, new_prompt, ids, logprobs, versions in rows:
            prompt = array("I") if anchor is None else tree.sequence_array(anchor)[:match_len]
            prompt += _unpack("I", new_prompt)
            result = tree.insert(prompt, _unpack("I", ids), _unpack("d", logprobs), _unpack("i", versions), request_id)
            if result.match_len < match_len:  # longer is fine: a request committed with it was planned before it
                raise ValueError(
                    f"replaying {request_id!r} of session {session_id!r} matched {result.match_len} tokens where "
                    f"the store recorded {match_len}: the store does not describe this tree"
                )
        return tree


def _record(row: tuple) -> TurnRecord:
    session_id, seq, request_id, anchor, match_len, _, new_prompt, ids, logprobs, versions, *rest = row
    finish_reason, text, created_s, meta = rest
    return TurnRecord(
        session_id,
        request_id,
        seq,
        anchor,
        match_len,
        tuple(_unpack("I", new_prompt)),
        tuple(_unpack("I", ids)),
        tuple(_unpack("d", logprobs)),
        tuple(_unpack("i", versions)),
        finish_reason,
        text,
        created_s,
        json.loads(meta),
    )
