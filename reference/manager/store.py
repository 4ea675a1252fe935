"""Durable, append-only storage of finished requests (SQLite in WAL mode) and replay into prefix trees.

Each finished request is one `TurnRecord`: only what it added (prompt[match_len:] and its generated tokens)
plus the anchor request whose sequence supplies prompt[:match_len]. An append therefore costs O(new
tokens) however long the session is, and `load_tree` rebuilds a session's tree by replaying its records in
order. The manager passes the `InsertResult` of `PrefixTree.insert` straight through:
`append(..., result.anchor_request_id, result.match_len, prompt[result.match_len:], ...)`.

Durability: WAL with synchronous=NORMAL, so a committed append survives the process being killed (power
loss may lose the last commits since the last checkpoint). Token arrays are stored as little-endian blobs
(uint32 ids, float64 logprobs, int32 versions), not JSON. Connections, each used by one thread at a
time under its own lock: one writes, one reads (WAL readers never wait for the writer) and one answers
`probe_session` without ever waiting.

The journal: `journal` takes finished requests without touching SQLite, for an event loop. It checks
them as `append` does, appends them to a journal segment next to the database (`<store>-records-<n>`:
length-prefixed, CRC-checked frames, one `write` per call) and returns; a worker thread then folds the
journaled records into SQLite in one transaction per segment (`flush`). A journaled record is as durable
as a commit (written to the file before `journal` returns: it survives the process being killed) and
every read of this store sees it (reads fold the journal first); other processes reading the file see
it once folded. A store opened on a file whose journal a killed process left folds that journal first,
skipping records already folded and a torn last frame. Writes that go straight to SQLite (`append`,
`append_many`) fold the journal first, so records land in the order they were taken.

Failures are explicit: a write that SQLite cannot complete (disk full, another process holding the write
lock past `busy_timeout_s`) raises `StoreError` and leaves nothing half-written; before every write the
store checks that its files are still the ones it opened, so a store deleted or replaced while serving is
reported at once instead of silently losing everything at the next restart.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import logging
import os
import sqlite3
import struct
import sys
import threading
import time
import zlib
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
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


log = logging.getLogger(__name__)

JOURNAL_INFIX = "-records-"  # journal segments: <store>-records-<n>
FOLD_RECORDS = 256  # journaled records in one segment; a full segment is sealed and due to be folded
MAX_UNFOLDED = 8192  # journaled records not yet folded, at most (past it, `journal` declines)
KNOWN_RECORDS = 16384  # the newest records' sizes kept in memory, so `journal` checks anchors at once
CHECK_FILES_S = 0.05  # `journal` checks that the store's files are still there at most this often
_FRAME = struct.Struct("<II")  # a journal frame's header: payload length, CRC-32 of the payload
# a record's numbers (match_len, num_tokens, created_s), then the lengths of its ten byte fields (session_id,
# request_id, anchor_request_id, finish_reason, text, meta, and its four arrays), then those fields
_HEAD = struct.Struct("<qqd10I")
_ABSENT = 0xFFFFFFFF  # the length of anchor_request_id when it is None
_META_JSON = json.JSONEncoder(sort_keys=True, allow_nan=False).encode
_SIZE_QUERY = "SELECT num_tokens FROM turns WHERE session_id = ? AND request_id = ?"
_BUSY = object()  # what `_probe` returns when the read would have waited


class StoreError(RuntimeError):
    """The durable store cannot take a write (disk full, locked too long, its files removed or replaced)."""


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
        turn.session_id,
        turn.request_id,
        turn.anchor_request_id,
        turn.match_len,
    )
    new_prompt_token_ids, token_ids, logprobs, versions = (
        turn.new_prompt_token_ids,
        turn.token_ids,
        turn.logprobs,
        turn.versions,
    )
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
        meta_json = "{}" if meta is None else _META_JSON(meta)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be a JSON-serialisable dict: {e}") from None
    blobs = (
        _pack("new_prompt_token_ids", "I", new_prompt_token_ids),
        _pack("token_ids", "I", token_ids),
        _pack("logprobs", "d", logprobs),
        _pack("versions", "i", versions),
    )
    num_tokens = match_len + len(new_prompt_token_ids) + len(token_ids)
    return (
        session_id,
        request_id,
        anchor_request_id,
        match_len,
        num_tokens,
        blobs,
        (finish_reason, text, time.time(), meta_json),
    )


def _frame(row: tuple) -> bytes:
    """A prepared record as one journal frame (UnicodeEncodeError, a ValueError, for text SQLite would refuse)."""
    session_id, request_id, anchor, match_len, num_tokens, (a, b, c, d), (finish, text, created_s, meta) = row
    s, r, f, t, m = session_id.encode(), request_id.encode(), finish.encode(), text.encode(), meta.encode()
    n = b"" if anchor is None else anchor.encode()
    head = _HEAD.pack(
        match_len,
        num_tokens,
        created_s,
        len(s),
        len(r),
        _ABSENT if anchor is None else len(n),
        len(f),
        len(t),
        len(m),
        len(a),
        len(b),
        len(c),
        len(d),
    )
    payload = b"".join((head, s, r, n, f, t, m, a, b, c, d))
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _unframe(payload: bytes) -> tuple:
    """The prepared record in a journal frame's payload (ValueError if it is not one)."""
    try:
        match_len, num_tokens, created_s, *lengths = _HEAD.unpack_from(payload, 0)
        at, fields = _HEAD.size, []
        for n in lengths:
            if n == _ABSENT:
                fields.append(None)
                continue
            if at + n > len(payload):
                raise ValueError("not a journal record: a field runs past the frame")
            fields.append(payload[at : at + n])
            at += n
        if at != len(payload):
            raise ValueError("not a journal record: bytes after the last field")
        session_id, request_id, anchor, finish, text, meta = (None if f is None else f.decode() for f in fields[:6])
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"not a journal record: {e}") from None
    if None in (session_id, request_id, finish, text, meta):
        raise ValueError("not a journal record: a field that cannot be absent is")
    return session_id, request_id, anchor, match_len, num_tokens, tuple(fields[6:]), (finish, text, created_s, meta)


def _read_frames(data: bytes) -> tuple[list[tuple], int]:
    """The records of a journal segment, and how many bytes at its end were left out (a frame cut short or
    damaged: what a process killed in the middle of a write leaves; nothing after it is trusted)."""
    rows, at = [], 0
    while at + _FRAME.size <= len(data):
        n, crc = _FRAME.unpack_from(data, at)
        payload = data[at + _FRAME.size : at + _FRAME.size + n]
        if len(payload) < n or zlib.crc32(payload) != crc:
            break
        try:
            rows.append(_unframe(payload))
        except ValueError:
            break
        at += _FRAME.size + n
    return rows, len(data) - at


@dataclass
class _Segment:
    """One journal file, open for appending and locked (flock) so no other process folds it meanwhile."""

    path: str
    fd: int
    inode: int
    rows: list[tuple] = field(default_factory=list)  # prepared records, in the order written
    size: int = 0  # bytes of whole frames written

    def intact(self) -> bool:
        """Whether the file is still there under its name (someone may have removed it)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False


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
        self._closed = False
        self._max_bytes: int | None = None
        # the journal: touched under _journal_lock; folded under _lock (then _journal_lock)
        self._journal_lock = threading.Lock()
        self._segment: _Segment | None = None  # the segment `journal` appends to
        self._sealed: list[_Segment] = []  # full segments, oldest first, waiting to be folded
        self._unfolded = 0  # records journaled and not yet folded
        self._unfolded_sessions: dict[str, int] = {}  # session id -> its records among them
        self._known: dict[tuple[str, str], int] = {}  # (session, request) -> num_tokens of the newest records
        self._fold_error: str | None = None  # why the last fold failed (None: it did not)
        self._last_segment = 0
        self._gone: str | None = None  # why the files cannot be trusted (once true, for good)
        self._files_checked_s = 0.0
        try:
            self._conn = self._connect(busy_timeout_s)
        except sqlite3.Error as e:
            raise ValueError(f"cannot open a trajectory store at {self.path}: {e}") from None
        try:
            self._open()
            self._read, self._read_lock = self._conn, self._lock
            self._probe_conn: sqlite3.Connection | None = None
            self._probe_lock = threading.Lock()
            if not self.memory:
                self._read, self._read_lock = self._connect(5.0), threading.Lock()
        except sqlite3.DatabaseError as e:
            self._conn.close()
            if isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e)):
                raise ValueError(
                    f"{self.path} is locked by another process ({e}); stop the other writer or give another store"
                ) from None
            raise ValueError(f"{self.path} is not a trajectory store: {e}") from None
        except BaseException:
            self._conn.close()
            raise
        self._identity = self._file_identity()
        if not self.memory:
            try:
                self._recover()
            except BaseException:
                self.close()
                raise
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
            self._max_bytes = max_bytes  # with a cap, records go straight to SQLite, which enforces it

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
        if self._gone is None:
            self._files_checked_s = time.monotonic()
            for name, identity in self._identity.items():
                try:
                    st = os.stat(name)
                except FileNotFoundError:
                    self._gone = f"the trajectory store file {name} was removed while the manager was running"
                    break
                if (st.st_dev, st.st_ino) != identity:
                    self._gone = f"the trajectory store file {name} was replaced while the manager was running"
                    break
        return self._gone

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
    def _transaction(self) -> Iterator[None]:
        """A write transaction on the writing connection."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite may already have rolled back (e.g. disk full)
                conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _writing(self, what: str, locked: bool = False) -> Iterator[None]:
        """A write transaction under the write lock (`locked`: the caller holds it); SQLite failures and a
        missing file become StoreError."""
        with nullcontext() if locked else self._lock:
            self._refuse_if_gone(what)
            try:
                with self._transaction():
                    yield
            except sqlite3.Error as e:
                raise StoreError(f"the trajectory store {self.path} could not {what}: {e}") from e
        if len(self._identity) < 2:  # the write-ahead log appears with the first write
            self._identity = self._file_identity()

    def _refuse_if_gone(self, what: str) -> None:
        if (problem := self.problem()) is not None:
            raise StoreError(f"{problem}; refusing to {what} (restart the manager to open a store)")

    def close(self) -> None:
        """Fold what the journal holds and close. If SQLite cannot take it (disk full), it stays in the
        journal's files and is folded when the store is next opened."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            try:
                self._fold()
            except StoreError as e:
                log.error(
                    "%d journaled records stay in %s%s* until the store is opened again: %s",
                    self._unfolded,
                    self.path,
                    JOURNAL_INFIX,
                    e,
                )
            with self._journal_lock:
                for segment in [*self._sealed, *([self._segment] if self._segment else [])]:
                    os.close(segment.fd)
                self._sealed, self._segment = [], None
            self._conn.close()
        if self._read is not self._conn:
            with self._read_lock:
                self._read.close()
        if self._probe_conn is not None and self._probe_conn is not self._conn:
            with self._probe_lock:
                self._probe_conn.close()

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
        turn = NewTurn(
            session_id,
            request_id,
            anchor_request_id,
            match_len,
            new_prompt_token_ids,
            token_ids,
            logprobs,
            versions,
            finish_reason,
            text,
            meta,
        )
        return _record(self._append([turn])[0])

    def append_many(self, turns: Sequence[NewTurn]) -> list[int]:
        """Store several finished requests, in order, in ONE transaction: all or none; returns their seqs.
        A busy manager commits the requests that finished together at once. ValueError for a malformed
        or inconsistent record; StoreError when the store cannot write. The journal is folded first."""
        return [row[1] for row in self._append(turns)]

    def _append(self, turns: Sequence[NewTurn]) -> list[tuple]:
        prepared = [_prepare(t) for t in turns]
        with self._lock:
            self._fold()
            with self._writing("store a finished request", locked=True):
                rows = self._insert(prepared)
        self._remember(prepared)
        return rows

    def _insert(self, prepared: list[tuple], skip_stored: bool = False, checked: bool = False) -> list[tuple]:
        """The rows of prepared records, inserted inside the caller's transaction (`skip_stored`: leaving
        out records already stored, as a journal folded again after a crash holds; `checked`: their
        anchors were checked when they were journaled)."""
        conn, rows, last_seq, sizes = self._conn, [], {}, {}
        for session_id, request_id, anchor, match_len, num_tokens, blobs, tail in prepared:
            if skip_stored and self._stored_size(session_id, request_id) is not None:
                continue
            if anchor is not None and not checked:
                size = sizes.get((session_id, anchor))
                size = self._stored_size(session_id, anchor) if size is None else size
                _check_anchor(session_id, anchor, match_len, size)
            if session_id in last_seq:
                seq = last_seq[session_id]
            else:
                seq = conn.execute("SELECT MAX(seq) FROM turns WHERE session_id = ?", (session_id,)).fetchone()[0]
                if seq is None:
                    conn.execute("INSERT OR IGNORE INTO sessions VALUES (?, ?)", (session_id, tail[2]))
            seq = last_seq[session_id] = 0 if seq is None else seq + 1
            row = (session_id, seq, request_id, anchor, match_len, num_tokens, *blobs, *tail)
            try:
                conn.execute(f"INSERT INTO turns ({_COLUMNS}) VALUES ({', '.join('?' * 14)})", row)
            except sqlite3.IntegrityError:  # UNIQUE (session_id, request_id)
                raise ValueError(f"request_id {request_id!r} is already stored in session {session_id!r}") from None
            sizes[session_id, request_id] = num_tokens
            rows.append(row)
        return rows

    def _stored_size(self, session_id: str, request_id: str) -> int | None:
        found = self._conn.execute(_SIZE_QUERY, (session_id, request_id)).fetchone()
        return None if found is None else found[0]

    # ---- the journal ----

    def journal(self, turns: Sequence[NewTurn]) -> bool | None:
        """Take finished requests durably without touching SQLite and without waiting (for an event loop):
        checked as `append_many` checks them, written to the journal in one `write`, folded into SQLite
        later by `flush`. Returns whether a fold is due (a segment is full), or None when nothing was taken
        and `append_many` must store the records: a store in memory or under a size cap, a failing
        fold, too many records waiting to be folded, another thread journaling, or an anchor only SQLite
        knows while its connection is busy. ValueError for a malformed or inconsistent record; StoreError
        when the journal cannot be written (nothing was taken)."""
        if self.memory or self._max_bytes is not None or self._fold_error is not None or self._closed:
            return None
        if not self._journal_lock.acquire(blocking=False):
            return None
        try:
            if self._unfolded + len(turns) > MAX_UNFOLDED:
                return None
            prepared = [_prepare(t) for t in turns]
            if not self._check_journaled(prepared):
                return None
            frames = b"".join(_frame(row) for row in prepared)
            if self._gone is not None or time.monotonic() - self._files_checked_s > CHECK_FILES_S:
                self._refuse_if_gone("store a finished request")
                if self._segment is not None and not self._segment.intact():
                    self._rewrite_lost_segment()  # its records durable again in a new file, before new ones
            segment = self._segment or self._open_segment()
            try:
                written = os.write(segment.fd, frames)
                if written != len(frames):
                    raise OSError(errno.ENOSPC, f"wrote {written} of {len(frames)} bytes")
            except OSError as e:
                with suppress(OSError):
                    os.ftruncate(segment.fd, segment.size)  # no torn frame is left before later ones
                self._seal()  # nor anything written after one
                raise StoreError(f"the trajectory store {self.path} could not store a finished request: {e}") from e
            segment.size += len(frames)
            segment.rows += prepared
            self._unfolded += len(prepared)
            for row in prepared:
                self._unfolded_sessions[row[0]] = self._unfolded_sessions.get(row[0], 0) + 1
            self._remember(prepared, locked=True)
            if len(segment.rows) >= FOLD_RECORDS:
                self._seal()
            return bool(self._sealed)
        finally:
            self._journal_lock.release()

    def flush(self) -> int:
        """Fold every journaled record into SQLite (from a worker thread: this waits for the write lock);
        returns how many were folded. StoreError when SQLite cannot take them: they stay journaled,
        `journal` declines until a fold succeeds, and the next `flush` or write tries again."""
        with self._lock:
            return self._fold()

    @property
    def unfolded(self) -> int:
        """Records journaled and not yet folded into SQLite."""
        return self._unfolded

    @property
    def fold_failing(self) -> bool:
        """The last fold failed (its records are journaled; `journal` declines until a fold succeeds)."""
        return self._fold_error is not None

    def _check_journaled(self, prepared: list[tuple]) -> bool:
        """The checks `_insert` makes, against the records in memory (and SQLite for an older anchor);
        False when that lookup would wait."""
        batch: dict[tuple[str, str], int] = {}
        for session_id, request_id, anchor, match_len, num_tokens, *_ in prepared:
            if (session_id, request_id) in batch or (session_id, request_id) in self._known:
                raise ValueError(f"request_id {request_id!r} is already stored in session {session_id!r}")
            if anchor is not None:
                size = batch.get((session_id, anchor), self._known.get((session_id, anchor)))
                if size is None:
                    found = self._probe(_SIZE_QUERY, (session_id, anchor))
                    if found is _BUSY:
                        return False
                    size = None if found is None else found[0]
                _check_anchor(session_id, anchor, match_len, size)
            batch[session_id, request_id] = num_tokens
        return True

    def _remember(self, prepared: list[tuple], locked: bool = False) -> None:
        """Keep the sizes of the newest records (every unfolded one among them: MAX_UNFOLDED < KNOWN_RECORDS)."""
        with nullcontext() if locked else self._journal_lock:
            known = self._known
            for row in prepared:
                known[row[0], row[1]] = row[4]
            while len(known) > KNOWN_RECORDS:
                del known[next(iter(known))]

    def _open_segment(self) -> _Segment:
        """A new journal file of our own (under _journal_lock)."""
        while True:
            self._last_segment += 1
            path = f"{self.path}{JOURNAL_INFIX}{self._last_segment}"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue
            except OSError as e:
                raise StoreError(f"the trajectory store {self.path} could not open its journal {path}: {e}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                inode = os.fstat(fd).st_ino
                if inode == os.stat(path).st_ino:  # not folded away by a store opened meanwhile
                    self._segment = _Segment(path, fd, inode)
                    return self._segment
            except OSError:
                pass
            os.close(fd)

    def _rewrite_lost_segment(self) -> None:
        """The current journal file was removed (an operator's cleanup): its records, answered and not yet folded,
        had their only copy in memory, and a crash would lose them. Write them to a new file at once (under
        _journal_lock); if that fails, they still fold from memory (StoreError for the write that found it)."""
        lost, self._segment = self._segment, None
        log.warning(
            "the journal file %s was removed: its %d records are written to a new one", lost.path, len(lost.rows)
        )
        frames = b"".join(_frame(row) for row in lost.rows)
        try:
            segment = self._open_segment()
            written = os.write(segment.fd, frames) if frames else 0
            if written != len(frames):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(frames)} bytes")
        except (OSError, StoreError) as e:
            if self._segment is not None:  # the new file, emptied: folded (and removed) with nothing in it
                with suppress(OSError):
                    os.ftruncate(self._segment.fd, 0)
                self._seal()
            self._sealed.append(lost)  # its records fold from memory
            raise StoreError(
                f"the trajectory store {self.path} lost its journal file and could not write its records again: {e}"
            ) from e
        with suppress(OSError):
            os.close(lost.fd)
        segment.size, segment.rows = len(frames), list(lost.rows)

    def _seal(self) -> None:
        """The current segment takes no more records and waits to be folded (under _journal_lock)."""
        if self._segment is not None:
            self._sealed.append(self._segment)
            self._segment = None

    def _fold(self) -> int:
        """Fold every journaled record into SQLite in one transaction, then remove its files (under _lock)."""
        with self._journal_lock:
            self._seal()
            sealed = list(self._sealed)
        rows = [row for segment in sealed for row in segment.rows]
        if rows:
            try:
                self._fold_rows(rows)
            except StoreError as e:
                self._fold_error = str(e)
                raise
        self._fold_error = None
        with self._journal_lock:
            del self._sealed[: len(sealed)]
            self._unfolded -= len(rows)
            counts = self._unfolded_sessions
            for row in rows:
                if counts[row[0]] == 1:
                    del counts[row[0]]
                else:
                    counts[row[0]] -= 1
        for segment in sealed:
            with suppress(FileNotFoundError):
                os.unlink(segment.path)
            os.close(segment.fd)
        return len(rows)

    def _fold_rows(self, rows: list[tuple], skip_stored: bool = False) -> int:
        """Insert journaled records in one transaction; if one is refused (a record `journal` could not
        check, such as a request id reused from long ago), each alone, the refused ones logged and left out.
        Returns how many were inserted."""
        try:
            with self._writing("store finished requests", locked=True):
                return len(self._insert(rows, skip_stored, checked=not skip_stored))
        except ValueError:
            pass
        inserted = 0
        for row in rows:
            try:
                with self._writing("store a finished request", locked=True):
                    inserted += len(self._insert([row], skip_stored))
            except ValueError as e:
                log.error("journaled request %r of session %r is left out of the store: %s", row[1], row[0], e)
        return inserted

    def _recover(self) -> None:
        """Fold the journal segments a killed process left (not those another live process holds)."""
        pattern = glob.escape(self.path) + JOURNAL_INFIX + "*"
        found = []
        for path in glob.glob(pattern):
            suffix = path[len(self.path) + len(JOURNAL_INFIX) :]
            if suffix.isdigit():
                found.append((int(suffix), path))
        for number, path in sorted(found):
            self._last_segment = max(self._last_segment, number)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live store's
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                rows, left_out = _read_frames(b"".join(chunks))
                if left_out:
                    log.warning(
                        "%s ends in %d bytes that are not a whole record (a write cut short); left out", path, left_out
                    )
                with self._lock:
                    inserted = self._fold_rows(rows, skip_stored=True)
                if inserted:
                    log.warning("folded %d records a previous process journaled in %s and did not fold", inserted, path)
                os.unlink(path)
            finally:
                os.close(fd)

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

    def _catch_up(self) -> None:
        """Reads see every journaled record: what is journaled is folded first."""
        if self._unfolded:
            self.flush()

    def records(self, session_id: str) -> list[TurnRecord]:
        """The session's records in seq order; [] for an unknown session."""
        self._catch_up()
        with self._read_lock:
            rows = self._read.execute(
                f"SELECT {_COLUMNS} FROM turns WHERE session_id = ? ORDER BY seq", (session_id,)
            ).fetchall()
        return [_record(row) for row in rows]

    def sessions(self) -> list[str]:
        """Every session id, in the order of their first record."""
        self._catch_up()
        with self._read_lock:
            return [r[0] for r in self._read.execute("SELECT session_id FROM sessions ORDER BY rowid")]

    def probe_session(self, session_id: str) -> bool | None:
        """Whether the session is stored, if that can be told at once: a primary-key lookup on a connection of
        its own that never waits (None when it would: another process holds the database, or another
        thread is using the connection). For an event loop, where `has_session` could block."""
        if session_id in self._unfolded_sessions:
            return True
        found = self._probe("SELECT 1 FROM sessions WHERE session_id = ?", (session_id,))
        return None if found is _BUSY else found is not None

    def _probe(self, query: str, args: tuple) -> tuple | None | object:
        """The first row of a read on the connection that never waits; _BUSY when it would have waited
        (another process holds the database, or another thread is using the connection)."""
        lock = self._lock if self.memory else self._probe_lock
        if not lock.acquire(blocking=False):
            return _BUSY
        try:
            if self._probe_conn is None:
                self._probe_conn = self._conn if self.memory else self._connect(0.0)
            return self._probe_conn.execute(query, args).fetchone()
        except sqlite3.Error:
            return _BUSY
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
        self._catch_up()
        with self._read_lock:
            query = "SELECT 1 FROM sessions WHERE session_id = ?"
            return self._read.execute(query, (session_id,)).fetchone() is not None

    def load_tree(self, session_id: str) -> PrefixTree:
        """Rebuild the session's tree by replaying its records in order (KeyError for an unknown session)."""
        self._catch_up()
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


def _check_anchor(session_id: str, anchor_request_id: str, match_len: int, size: int | None) -> None:
    """An anchor must be stored in the session, with at least match_len tokens (`size`: its num_tokens)."""
    if size is None:
        raise ValueError(f"anchor_request_id {anchor_request_id!r} is not stored in session {session_id!r}")
    if match_len > size:
        raise ValueError(
            f"match_len {match_len} is longer than anchor {anchor_request_id!r}'s sequence ({size} tokens)"
        )


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
