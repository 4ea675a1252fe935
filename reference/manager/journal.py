"""The trajectory store's journal: finished requests taken without touching SQLite, for an event loop.

`TrajectoryStore.journal` checks records as `append` does and hands them here: they are appended to a
journal segment next to the database (`<store>-records-<n>`: length-prefixed, CRC-checked frames, one
`write` per call). A full segment is sealed; the store folds the sealed segments into SQLite in one
transaction (`TrajectoryStore.flush`, from a worker thread) and `drop`s them. A journaled record is as
durable as a commit (written to the file before `journal` returns: it survives the process being killed).

Each segment is locked (flock) by the process writing it, so a store opened beside a live one leaves its
journal alone, while a store opened on a file whose journal a killed process left folds that journal first
(`recover`), skipping records already folded and a torn last frame: nothing after a frame cut short or
damaged is trusted. A segment removed while serving (an operator's cleanup) is written again at once
(`replace_if_lost`), since its records' only other copy was in memory.

Locking: the journal's state is touched under `lock`; the store folds under its own write lock, then this one.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field

from reference.manager.errors import StoreError

log = logging.getLogger(__name__)

JOURNAL_INFIX = "-records-"  # journal segments: <store>-records-<n>
FOLD_RECORDS = 256  # journaled records in one segment; a full segment is sealed and due to be folded
MAX_UNFOLDED = 8192  # journaled records not yet folded, at most (past it, `journal` declines)
KNOWN_RECORDS = 16384  # the newest records' sizes kept in memory, so `journal` checks anchors at once
_FRAME = struct.Struct("<II")  # a journal frame's header: payload length, CRC-32 of the payload
# a record's numbers (match_len, num_tokens, created_s), then the lengths of its ten byte fields (session_id,
# request_id, anchor_request_id, finish_reason, text, meta, and its four arrays), then those fields
_HEAD = struct.Struct("<qqd10I")
_ABSENT = 0xFFFFFFFF  # the length of anchor_request_id when it is None


def frame(row: tuple) -> bytes:
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


def unframe(payload: bytes) -> tuple:
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


def read_frames(data: bytes) -> tuple[list[tuple], int]:
    """The records of a journal segment, and how many bytes at its end were left out (a frame cut short or
    damaged: what a process killed in the middle of a write leaves; nothing after it is trusted)."""
    rows, at = [], 0
    while at + _FRAME.size <= len(data):
        n, crc = _FRAME.unpack_from(data, at)
        payload = data[at + _FRAME.size : at + _FRAME.size + n]
        if len(payload) < n or zlib.crc32(payload) != crc:
            break
        try:
            rows.append(unframe(payload))
        except ValueError:
            break
        at += _FRAME.size + n
    return rows, len(data) - at


@dataclass
class Segment:
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


class Journal:
    """The journal segments of the store at `path`, and what they hold that SQLite does not have yet."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.segment: Segment | None = None  # the segment `write` appends to
        self.sealed: list[Segment] = []  # full segments, oldest first, waiting to be folded
        self.unfolded = 0  # records journaled and not yet folded
        self.unfolded_sessions: dict[str, int] = {}  # session id -> its records among them
        self.known: dict[tuple[str, str], int] = {}  # (session, request) -> num_tokens of the newest records
        self._last_number = 0

    def write(self, prepared: list[tuple], frames: bytes) -> bool:
        """Append the prepared records, framed as `frames`, in one `write` (under `lock`); returns whether a
        fold is due (a segment is full). StoreError when the file cannot take them: nothing is taken, and no
        torn frame is left."""
        segment = self.segment or self._open_segment()
        try:
            written = os.write(segment.fd, frames)
            if written != len(frames):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(frames)} bytes")
        except OSError as e:
            with suppress(OSError):
                os.ftruncate(segment.fd, segment.size)  # no torn frame is left before later ones
            self.seal()  # nor anything written after one
            raise StoreError(f"the trajectory store {self.path} could not store a finished request: {e}") from e
        segment.size += len(frames)
        segment.rows += prepared
        self.unfolded += len(prepared)
        for row in prepared:
            self.unfolded_sessions[row[0]] = self.unfolded_sessions.get(row[0], 0) + 1
        self.remember(prepared, locked=True)
        if len(segment.rows) >= FOLD_RECORDS:
            self.seal()
        return bool(self.sealed)

    def remember(self, prepared: list[tuple], locked: bool = False) -> None:
        """Keep the sizes of the newest records (every unfolded one among them: MAX_UNFOLDED < KNOWN_RECORDS)."""
        with nullcontext() if locked else self.lock:
            known = self.known
            for row in prepared:
                known[row[0], row[1]] = row[4]
            while len(known) > KNOWN_RECORDS:
                del known[next(iter(known))]

    def replace_if_lost(self) -> None:
        """Write the current segment's records to a new file if its own was removed (under `lock`)."""
        if self.segment is not None and not self.segment.intact():
            self._rewrite_lost_segment()  # its records durable again in a new file, before new ones

    def _open_segment(self) -> Segment:
        """A new journal file of our own (under `lock`)."""
        while True:
            self._last_number += 1
            path = f"{self.path}{JOURNAL_INFIX}{self._last_number}"
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
                    self.segment = Segment(path, fd, inode)
                    return self.segment
            except OSError:
                pass
            os.close(fd)

    def _rewrite_lost_segment(self) -> None:
        """The current journal file was removed (an operator's cleanup): its records, answered and not yet folded,
        had their only copy in memory, and a crash would lose them. Write them to a new file at once (under
        `lock`); if that fails, they still fold from memory (StoreError for the write that found it)."""
        lost, self.segment = self.segment, None
        log.warning(
            "the journal file %s was removed: its %d records are written to a new one", lost.path, len(lost.rows)
        )
        frames = b"".join(frame(row) for row in lost.rows)
        try:
            segment = self._open_segment()
            written = os.write(segment.fd, frames) if frames else 0
            if written != len(frames):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(frames)} bytes")
        except (OSError, StoreError) as e:
            if self.segment is not None:  # the new file, emptied: folded (and removed) with nothing in it
                with suppress(OSError):
                    os.ftruncate(self.segment.fd, 0)
                self.seal()
            self.sealed.append(lost)  # its records fold from memory
            raise StoreError(
                f"the trajectory store {self.path} lost its journal file and could not write its records again: {e}"
            ) from e
        with suppress(OSError):
            os.close(lost.fd)
        segment.size, segment.rows = len(frames), list(lost.rows)

    def seal(self) -> None:
        """The current segment takes no more records and waits to be folded (under `lock`)."""
        if self.segment is not None:
            self.sealed.append(self.segment)
            self.segment = None

    def take(self) -> list[Segment]:
        """Every segment with records to fold, the current one sealed first; `drop` them once folded."""
        with self.lock:
            self.seal()
            return list(self.sealed)

    def drop(self, folded: list[Segment]) -> None:
        """Forget the segments `take` gave, their records now in SQLite, and remove their files."""
        with self.lock:
            del self.sealed[: len(folded)]
            self.unfolded -= sum(len(segment.rows) for segment in folded)
            counts = self.unfolded_sessions
            for row in (row for segment in folded for row in segment.rows):
                if counts[row[0]] == 1:
                    del counts[row[0]]
                else:
                    counts[row[0]] -= 1
        for segment in folded:
            with suppress(FileNotFoundError):
                os.unlink(segment.path)
            os.close(segment.fd)

    def close(self) -> None:
        """Close the segments' files; what they hold and was not folded is folded when the store is next opened."""
        with self.lock:
            for segment in [*self.sealed, *([self.segment] if self.segment else [])]:
                os.close(segment.fd)
            self.sealed, self.segment = [], None

    def recover(self, fold: Callable[[list[tuple]], int]) -> None:
        """Fold (`fold(rows)`: how many were inserted) the journal segments a killed process left, oldest first,
        then remove them; those another live process holds are left alone."""
        found = []
        for path in glob.glob(glob.escape(self.path) + JOURNAL_INFIX + "*"):
            suffix = path[len(self.path) + len(JOURNAL_INFIX) :]
            if suffix.isdigit():
                found.append((int(suffix), path))
        for number, path in sorted(found):
            self._last_number = max(self._last_number, number)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live store's
                _recover_file(fd, path, fold)
            finally:
                os.close(fd)


def _recover_file(fd: int, path: str, fold: Callable[[list[tuple]], int]) -> None:
    """Fold the whole records of one left journal file (open as `fd`, locked), then remove it."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    rows, left_out = read_frames(b"".join(chunks))
    if left_out:
        log.warning("%s ends in %d bytes that are not a whole record (a write cut short); left out", path, left_out)
    inserted = fold(rows)
    if inserted:
        log.warning("folded %d records a previous process journaled in %s and did not fold", inserted, path)
    os.unlink(path)
