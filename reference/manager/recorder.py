"""Recording finished requests: durably first, then into the session's tree.

A request becomes visible (in its session's tree, to later turns, to readers) only after its record is
durably in the store (journaled or committed), so a failed write leaves nothing behind and the session
goes on from what is stored: when the disk has room again, the next turn works. The record is planned
against the tree as it is (`PrefixTree.plan`: the longest stored prefix and the request it belongs to),
which stays a valid anchor however many inserts land before it, since the tree only grows.

Group commit: records that finish in the same turn of the event loop, or while a write is under way,
are written together, in the order they finished, and inserted into their trees in that same order (the
order in which the store replays them). A small batch is journaled by the journal thread
(`TrajectoryStore.journal`: one `write` to the store's journal, tens of microseconds, never a wait for
SQLite: a lone agent's request then costs one thread hand-off and no SQLite transaction of its own); the
writer thread folds the journal into SQLite when a segment fills or `FOLD_AFTER_S` after a record was
journaled, so a transaction carries hundreds of records. Anything the journal declines (a large batch, a
store under a size cap, a fold that is failing, a malformed record to sort out) goes to the writer thread,
which stores it with `append_many`. The event loop never touches the disk: a stalled file system stalls
the records, not `/health` or the sessions' other work, and a request whose record is not durable within
`durable_within_s` is answered 503 (its record lands when the disk wakes, and is kept).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from reference.manager.prefix_tree import InsertResult
from reference.manager.sessions import Session
from reference.manager.store import NewTurn, StoreError, TrajectoryStore

log = logging.getLogger(__name__)

INLINE_MAX_TOKENS = 8192  # a batch of at most this many tokens is journaled (larger ones: SQLite directly)
STALLED_WRITE_S = 0.5  # a journal write slower than this is logged as a warning
DURABLE_WITHIN_S = 10.0  # a request whose record is not durable within this is answered 503
FOLD_AFTER_S = 0.1  # a journaled record is folded into SQLite within about this long
FOLD_RETRY_S = 1.0  # after a failed fold, the writer thread tries again this often
_FOLD = "fold"  # the writer thread's job besides batches


@dataclass
class _Pending:
    session: Session
    turn: NewTurn
    prompt: Sequence[int]
    done: asyncio.Future


class Recorder:
    """Group commit through one writer thread: the loop hands it a batch, the thread writes it and hands the
    outcome back with `call_soon_threadsafe`, and the loop inserts the batch into its trees."""

    def __init__(self, store: TrajectoryStore, durable_within_s: float = DURABLE_WITHIN_S) -> None:
        self.store, self.durable_within_s = store, durable_within_s
        self._pending: list[_Pending] = []  # records waiting for the writer
        self._writing = False  # a batch is with the writer thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._journal_inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._journal_thread: threading.Thread | None = None
        self._write_started: float | None = None  # monotonic start of the journal write under way, if any
        self.timed_out = 0  # requests answered 503 because their record was not durable in time
        self.committed = 0
        self.failed = 0
        self.last_failure: str | None = None  # the last write's error, until a write succeeds again
        self.last_failure_s: float | None = None
        self.journaled = 0  # of `committed`, the records journaled (the rest stored by the writer thread)
        self._fold_timer: asyncio.TimerHandle | None = None
        self._fold_queued = False
        self._fold_failed = False  # the last fold failed (and set last_failure)
        self._closed = False

    async def record(self, session: Session, turn: NewTurn, prompt: Sequence[int]) -> InsertResult:
        """Store `turn` durably, then insert it into `session.tree`; StoreError if the store failed (then
        nothing was recorded). The write and the insert happen even if the caller is cancelled meanwhile."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        session.in_flight += 1  # held in memory until its record lands
        self._pending.append(_Pending(session, turn, prompt, done))
        if not self._writing:
            self._writing = True
            loop.call_soon(self._hand_over, loop)  # after the records that finish in this turn of the loop
        try:
            return await asyncio.wait_for(asyncio.shield(done), self.durable_within_s)
        except TimeoutError:
            self.timed_out += 1
            done.add_done_callback(_retrieve)  # it lands later (and is kept); nobody reads its outcome
            raise StoreError(
                f"the trajectory store did not make the request durable within "
                f"{self.durable_within_s:g} s (a stalled disk?); it is kept if the write completes, "
                f"so a retry may add a second branch"
            ) from None

    def problem(self) -> str | None:
        """Why writes are failing now, or None."""
        started = self._write_started
        if started is not None and (waited := time.monotonic() - started) > STALLED_WRITE_S:
            return f"a journal write has been under way for {waited:.1f} s (a stalled disk?)"
        return self.store.problem() or self.last_failure

    def close(self) -> None:
        """Stop the journal and writer threads (the store's own `close` folds what is still journaled)."""
        self._closed = True
        for attr, inbox in (("_journal_thread", self._journal_inbox), ("_thread", self._inbox)):
            thread = getattr(self, attr)
            if thread is not None:
                inbox.put(None)
                thread.join(timeout=30)
                setattr(self, attr, None)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending, self._writing = self._pending, [], True
        small = sum(len(p.turn.token_ids) + len(p.turn.new_prompt_token_ids) for p in batch) <= INLINE_MAX_TOKENS
        if small and not self._closed:
            if self._journal_thread is None:
                self._journal_thread = threading.Thread(
                    target=self._journaler, name="trajectory-store-journal", daemon=True
                )
                self._journal_thread.start()
            self._journal_inbox.put((loop, batch))
            return
        self._to_writer((loop, batch))

    def _journaler(self) -> None:
        """The journal thread: each batch journaled, its outcome handed back to the loop (`_journaled`)."""
        while (item := self._journal_inbox.get()) is not None:
            loop, batch = item
            if not _hand_back(loop, self._journaled, loop, batch, self._journal(batch)):
                return

    def _journaled(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending], outcome) -> None:
        """On the loop: a batch's journal outcome: (errors, fold due), or None when the writer thread must take it."""
        if outcome is None:
            self._to_writer((loop, batch))
            return
        errors, fold_due = outcome
        if fold_due:
            self._fold_soon()
        elif fold_due is not None and self._fold_timer is None:
            self._fold_timer = loop.call_later(FOLD_AFTER_S, self._fold_soon)
        self._landed(loop, batch, errors)

    def _to_writer(self, item: tuple | str) -> None:
        if self._closed:  # shutting down: a batch fails (its requests get 503), a fold is left to store.close
            if isinstance(item, tuple):
                loop, batch = item
                self._landed(loop, batch, [StoreError("the trajectory manager is shutting down")] * len(batch))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="trajectory-store-writer", daemon=True)
            self._thread.start()
        self._inbox.put(item)

    def _journal(self, batch: list[_Pending]) -> tuple[list[Exception | None], bool | None] | None:
        """Journal `batch` (journal thread): (each record's error or None, whether a fold is due; None when the
        batch failed), or None when the writer thread must take it."""
        started = self._write_started = time.monotonic()
        try:
            fold_due = self.store.journal([p.turn for p in batch])
        except StoreError as e:
            return [e] * len(batch), None
        except ValueError:
            return None  # a malformed record: the writer thread stores the others one by one
        except Exception as e:  # noqa: BLE001 - as in _write
            log.exception("the trajectory store's journal failed")
            return [_unexpected(e)] * len(batch), None
        finally:
            self._write_started = None
            if (took := time.monotonic() - started) > STALLED_WRITE_S:
                log.warning("a journal write took %.0f ms (a slow disk?)", took * 1e3)
        if fold_due is None:
            return None
        self.journaled += len(batch)
        return [None] * len(batch), fold_due

    def _fold_soon(self) -> None:
        """Have the writer thread fold the journal into SQLite (on the loop)."""
        if self._fold_timer is not None:
            self._fold_timer.cancel()
            self._fold_timer = None
        if not self._fold_queued:
            self._fold_queued = True
            self._to_writer(_FOLD)

    def _writer(self) -> None:
        """The writer thread: folds of the journal, and batches the journal declined (one transaction per
        batch, each record alone if one is malformed)."""
        while True:
            try:
                item = self._inbox.get(timeout=FOLD_RETRY_S if self.store.fold_failing else None)
            except queue.Empty:
                item = _FOLD  # try a failed fold again
            if item is None:
                return
            if item == _FOLD:
                self._fold()
                continue
            loop, batch = item
            if not _hand_back(loop, self._landed, loop, batch, self._write(batch)):
                return

    def _fold(self) -> None:
        """Fold the journal into SQLite (writer thread). On failure the records stay journaled (durable),
        the store reports why, and the fold is tried again every FOLD_RETRY_S."""
        self._fold_queued = False
        try:
            self.store.flush()
        except Exception as e:  # noqa: BLE001 - the writer thread must survive anything
            message = str(e if isinstance(e, StoreError) else _unexpected(e))
            if message != self.last_failure:
                log.error("the trajectory store could not fold its journal: %s", message)
            self.last_failure, self.last_failure_s, self._fold_failed = message, time.time(), True
            return
        if self._fold_failed:  # (a write's failure is cleared by the next write that succeeds)
            self.last_failure, self._fold_failed = None, False

    def _write(self, batch: list[_Pending]) -> list[Exception | None]:
        """Each record's outcome (None: stored), from the writer thread."""
        try:
            self.store.append_many([p.turn for p in batch])
        except StoreError as e:
            return [e] * len(batch)
        except ValueError:
            return self._write_one_by_one(batch)
        except Exception as e:  # noqa: BLE001 - the writer thread must survive anything; callers learn why
            log.exception("the trajectory store writer failed")
            return [_unexpected(e)] * len(batch)
        return [None] * len(batch)

    def _write_one_by_one(self, batch: list[_Pending]) -> list[Exception | None]:
        """After a malformed record sank a batch: each record in its own transaction."""
        errors: list[Exception | None] = []
        for p in batch:
            try:
                self.store.append_many([p.turn])
                errors.append(None)
            except (StoreError, ValueError) as e:
                errors.append(e)
            except Exception as e:  # noqa: BLE001 - as in _write
                errors.append(_unexpected(e))
        return errors

    def _landed(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending], errors: list[Exception | None]) -> None:
        """On the loop: insert what was stored into its trees, in commit order, and answer the callers."""
        self._account(errors)
        for item, error in zip(batch, errors, strict=True):
            item.session.in_flight -= 1
            result: InsertResult | Exception | None = error
            if error is None:
                t = item.turn
                try:
                    result = item.session.tree.insert(item.prompt, t.token_ids, t.logprobs, t.versions, t.request_id)
                except Exception as e:  # noqa: BLE001 - stored but not in memory: the caller learns why
                    log.exception("request %s is stored but could not join its tree", t.request_id)
                    result = e
            if item.done.done():  # the caller went away; what was stored stays stored
                continue
            item.done.set_exception(result) if isinstance(result, Exception) else item.done.set_result(result)
        if self._pending:
            loop.call_soon(self._hand_over, loop)
        else:
            self._writing = False

    def _account(self, errors: list[Exception | None]) -> None:
        ok = errors.count(None)
        failures = [e for e in errors if isinstance(e, StoreError)]
        self.committed += ok
        self.failed += len(errors) - ok
        if failures:
            self.last_failure, self.last_failure_s = str(failures[-1]), time.time()
            log.error("the trajectory store failed to record %d request(s): %s", len(failures), failures[-1])
        elif ok:
            self.last_failure = None


def _hand_back(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """`fn(*args)` on `loop`, from a thread; False when the loop is closed (nobody is waiting any more)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _retrieve(future: asyncio.Future) -> None:
    """Mark a future's exception as read (its caller has gone: asyncio would log it as never retrieved)."""
    if not future.cancelled():
        future.exception()


def _unexpected(e: Exception) -> StoreError:
    """What an agent (and /health) is told of an error the store was not expected to raise."""
    return StoreError(f"the trajectory store failed: {e!r}")
