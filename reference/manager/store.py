"""Durable, append-only storage of finished requests (SQLite in WAL mode) and replay into prefix trees.

Each finished request is one `TurnRecord`: only what it added (prompt[match_len:] and its generated tokens)
plus the anchor request whose sequence supplies prompt[:match_len]. An append therefore costs O(new
tokens) however long the session is, and `load_tree` rebuilds a session's tree by replaying its records in
order. The manager passes the `InsertResult` of `PrefixTree.insert` straight through:
`append(..., result.anchor_request_id, result.match_len, prompt[result.match_len:], ...)`.

Durability: WAL with synchronous=NORMAL, so a committed append survives the process being killed (power
loss may lose the last commits since the last checkpoint). Records are checked and packed by `records.py`
(token arrays as little-endian blobs, not JSON). Connections, each used by one thread at a
time under its own lock: one writes, one reads (WAL readers never wait for the writer) and one answers
`probe_session` without ever waiting.

The journal (`journal.py`): `journal` takes finished requests without touching SQLite, for an event loop.
It checks them as `append` does and appends them to a journal segment next to the database; a worker thread
then folds the journaled records into SQLite in one transaction per segment (`flush`). A journaled record is
as durable as a commit and every read of this store sees it (reads fold the journal first); other processes
reading the file see it once folded. A store opened on a file whose journal a killed process left folds that
journal first. Writes that go straight to SQLite (`append`, `append_many`) fold the journal first, so
records land in the order they were taken.

Failures are explicit: a write that SQLite cannot complete (disk full, another process holding the write
lock past `busy_timeout_s`) raises `StoreError` and leaves nothing half-written; before every write the
store checks that its files are still the ones it opened, so a store deleted or replaced while serving is
reported at once instead of silently losing everything at the next restart.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from reference.manager.errors import StoreError
from reference.manager.journal import JOURNAL_INFIX, MAX_UNFOLDED, Journal, frame
from reference.manager.prefix_tree import PrefixTree
from reference.manager.records import NewTurn, TurnRecord, check_anchor, check_name, from_row, prepare, unpack
from reference.manager.schema import ADDITIVE, COLUMNS, FORMAT, SCHEMA, SCHEMA_VERSION

log = logging.getLogger(__name__)

CHECK_FILES_S = 0.05  # `journal` checks that the store's files are still there at most this often
_SIZE_QUERY = "SELECT num_tokens FROM turns WHERE session_id = ? AND request_id = ?"
_BUSY = object()  # what `_probe` returns when the read would have waited


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
        self._journal = Journal(self.path)  # folded under _lock (then the journal's own lock)
        self._fold_error: str | None = None  # why the last fold failed (None: it did not)
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
                for statement in (*SCHEMA, *ADDITIVE):
                    self._conn.execute(statement)
                self._conn.execute("INSERT INTO schema_version VALUES (?, ?)", (FORMAT, SCHEMA_VERSION))
                return
            found = self._conn.execute("SELECT format, version FROM schema_version").fetchall()
            if found != [(FORMAT, SCHEMA_VERSION)]:
                raise ValueError(
                    f"{self.path} is not a {FORMAT} of schema version {SCHEMA_VERSION}: schema_version holds {found}"
                )
            for statement in ADDITIVE:
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
                    self._journal.unfolded,
                    self.path,
                    JOURNAL_INFIX,
                    e,
                )
            self._journal.close()
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
        return from_row(self._append([turn])[0])

    def append_many(self, turns: Sequence[NewTurn]) -> list[int]:
        """Store several finished requests, in order, in ONE transaction: all or none; returns their seqs.
        A busy manager commits the requests that finished together at once. ValueError for a malformed
        or inconsistent record; StoreError when the store cannot write. The journal is folded first."""
        return [row[1] for row in self._append(turns)]

    def _append(self, turns: Sequence[NewTurn]) -> list[tuple]:
        prepared = [prepare(t) for t in turns]
        with self._lock:
            self._fold()
            with self._writing("store a finished request", locked=True):
                rows = self._insert(prepared)
        self._journal.remember(prepared)
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
                check_anchor(session_id, anchor, match_len, size)
            if session_id in last_seq:
                seq = last_seq[session_id]
            else:
                seq = conn.execute("SELECT MAX(seq) FROM turns WHERE session_id = ?", (session_id,)).fetchone()[0]
                if seq is None:
                    conn.execute("INSERT OR IGNORE INTO sessions VALUES (?, ?)", (session_id, tail[2]))
            seq = last_seq[session_id] = 0 if seq is None else seq + 1
            row = (session_id, seq, request_id, anchor, match_len, num_tokens, *blobs, *tail)
            try:
                conn.execute(f"INSERT INTO turns ({COLUMNS}) VALUES ({', '.join('?' * 14)})", row)
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
        journal = self._journal
        if not journal.lock.acquire(blocking=False):
            return None
        try:
            if journal.unfolded + len(turns) > MAX_UNFOLDED:
                return None
            prepared = [prepare(t) for t in turns]
            if not self._check_journaled(prepared):
                return None
            frames = b"".join(frame(row) for row in prepared)
            if self._gone is not None or time.monotonic() - self._files_checked_s > CHECK_FILES_S:
                self._refuse_if_gone("store a finished request")
                journal.replace_if_lost()
            return journal.write(prepared, frames)
        finally:
            journal.lock.release()

    def flush(self) -> int:
        """Fold every journaled record into SQLite (from a worker thread: this waits for the write lock);
        returns how many were folded. StoreError when SQLite cannot take them: they stay journaled,
        `journal` declines until a fold succeeds, and the next `flush` or write tries again."""
        with self._lock:
            return self._fold()

    @property
    def unfolded(self) -> int:
        """Records journaled and not yet folded into SQLite."""
        return self._journal.unfolded

    @property
    def fold_failing(self) -> bool:
        """The last fold failed (its records are journaled; `journal` declines until a fold succeeds)."""
        return self._fold_error is not None

    def _check_journaled(self, prepared: list[tuple]) -> bool:
        """The checks `_insert` makes, against the records in memory (and SQLite for an older anchor);
        False when that lookup would wait."""
        batch: dict[tuple[str, str], int] = {}
        for session_id, request_id, anchor, match_len, num_tokens, *_ in prepared:
            if (session_id, request_id) in batch or (session_id, request_id) in self._journal.known:
                raise ValueError(f"request_id {request_id!r} is already stored in session {session_id!r}")
            if anchor is not None:
                size = batch.get((session_id, anchor), self._journal.known.get((session_id, anchor)))
                if size is None:
                    found = self._probe(_SIZE_QUERY, (session_id, anchor))
                    if found is _BUSY:
                        return False
                    size = None if found is None else found[0]
                check_anchor(session_id, anchor, match_len, size)
            batch[session_id, request_id] = num_tokens
        return True

    def _fold(self) -> int:
        """Fold every journaled record into SQLite in one transaction, then remove its files (under _lock)."""
        sealed = self._journal.take()
        rows = [row for segment in sealed for row in segment.rows]
        if rows:
            try:
                self._fold_rows(rows)
            except StoreError as e:
                self._fold_error = str(e)
                raise
        self._fold_error = None
        self._journal.drop(sealed)
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

        def fold(rows: list[tuple]) -> int:
            with self._lock:
                return self._fold_rows(rows, skip_stored=True)

        self._journal.recover(fold)

    def annotate(self, session_id: str, updates: dict[str, Any], author: str = "") -> dict[str, Any]:
        """Merge `updates` into the session's annotations (dict values are merged key by key, others
        replaced) and append them to the session's annotation history, in one transaction; returns the
        merged annotations."""
        check_name("session_id", session_id)
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
        if self._journal.unfolded:
            self.flush()

    def records(self, session_id: str) -> list[TurnRecord]:
        """The session's records in seq order; [] for an unknown session."""
        self._catch_up()
        with self._read_lock:
            rows = self._read.execute(
                f"SELECT {COLUMNS} FROM turns WHERE session_id = ? ORDER BY seq", (session_id,)
            ).fetchall()
        return [from_row(row) for row in rows]

    def sessions(self) -> list[str]:
        """Every session id, in the order of their first record."""
        self._catch_up()
        with self._read_lock:
            return [r[0] for r in self._read.execute("SELECT session_id FROM sessions ORDER BY rowid")]

    def probe_session(self, session_id: str) -> bool | None:
        """Whether the session is stored, if that can be told at once: a primary-key lookup on a connection of
        its own that never waits (None when it would: another process holds the database, or another
        thread is using the connection). For an event loop, where `has_session` could block."""
        if session_id in self._journal.unfolded_sessions:
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
            check_name("item", item)
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
            prompt += unpack("I", new_prompt)
            result = tree.insert(prompt, unpack("I", ids), unpack("d", logprobs), unpack("i", versions), request_id)
            if result.match_len < match_len:  # longer is fine: a request committed with it was planned before it
                raise ValueError(
                    f"replaying {request_id!r} of session {session_id!r} matched {result.match_len} tokens where "
                    f"the store recorded {match_len}: the store does not describe this tree"
                )
        return tree
