"""Recording finished requests: durably first, then into the session's tree.

A request becomes visible (in its session's tree, to later turns, to readers) only after its record is
committed to the store, so a failed write leaves nothing behind and the session goes on from what is
stored: when the disk has room again, the next turn works. The record is planned against the tree as it
is (`PrefixTree.plan`: the longest stored prefix and the request it belongs to), which stays a valid
anchor however many inserts land before it, since the tree only grows.

Group commit: records that finish in the same turn of the event loop, or while a write is under way,
are written together in the next transaction, in the order they finished, and inserted into their trees
in that same order (the order in which the store replays them). A small batch is committed on the loop
itself when no other writer holds the store's lock (`append_many(wait=False)`: tens of microseconds,
never a wait, never a checkpoint: a lone agent's request then costs no thread hand-off); anything else
(a large batch, a lock held by another process, a malformed record to sort out) goes to one writer
thread, which also checkpoints the log every `CHECKPOINT_EVERY` commits made on the loop. The event loop
never waits on SQLite.
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

INLINE_MAX_TOKENS = 8192  # a batch of at most this many tokens may be committed on the loop
INLINE_SLOW_S = 0.01  # a commit on the loop slower than this (a slow disk) sends the next ones to the thread
INLINE_PAUSE_S = 10.0  # for this long
CHECKPOINT_EVERY = 256  # commits on the loop between two checkpoints by the writer thread
_CHECKPOINT = "checkpoint"  # the writer thread's job besides batches


@dataclass
class _Pending:
    session: Session
    turn: NewTurn
    prompt: Sequence[int]
    done: asyncio.Future


class Recorder:
    """Group commit through one writer thread: the loop hands it a batch, the thread writes it and hands the
    outcome back with `call_soon_threadsafe`, and the loop inserts the batch into its trees."""

    def __init__(self, store: TrajectoryStore) -> None:
        self.store = store
        self._pending: list[_Pending] = []  # records waiting for the writer
        self._writing = False  # a batch is with the writer thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.committed = 0
        self.failed = 0
        self.last_failure: str | None = None  # the last write's error, until a write succeeds again
        self.last_failure_s: float | None = None
        self.committed_on_loop = 0  # of `committed`, the records committed on the event loop
        self._since_checkpoint = 0
        self._inline_paused_until = 0.0  # monotonic time before which every batch goes to the thread

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
        return await done

    def problem(self) -> str | None:
        """Why writes are failing now, or None."""
        return self.store.problem() or self.last_failure

    def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending, self._writing = self._pending, [], True
        small = sum(len(p.turn.token_ids) + len(p.turn.new_prompt_token_ids) for p in batch) <= INLINE_MAX_TOKENS
        if small and time.monotonic() >= self._inline_paused_until:
            errors = self._write_now(batch)
            if errors is not None:
                self._landed(loop, batch, errors)
                return
        self._to_writer((loop, batch))

    def _to_writer(self, item: tuple | str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="trajectory-store-writer", daemon=True)
            self._thread.start()
        self._inbox.put(item)

    def _write_now(self, batch: list[_Pending]) -> list[Exception | None] | None:
        """Commit `batch` on the loop if nothing would wait; None: the writer thread must take it. A commit
        that took longer than INLINE_SLOW_S (a slow or throttled disk) sends the batches of the next
        INLINE_PAUSE_S to the writer thread."""
        started = time.monotonic()
        errors = self._write(batch, wait=False)
        took = time.monotonic() - started
        if took > INLINE_SLOW_S:
            self._inline_paused_until = time.monotonic() + INLINE_PAUSE_S
            log.warning("a commit on the event loop took %.0f ms: commits go to the writer thread for %.0f s",
                        took * 1e3, INLINE_PAUSE_S)  # fmt: skip
        if errors is None or any(e is not None for e in errors):
            return errors
        self.committed_on_loop += len(batch)
        self._since_checkpoint += 1
        if self._since_checkpoint >= CHECKPOINT_EVERY:
            self._since_checkpoint = 0
            self._to_writer(_CHECKPOINT)
        return errors

    def _writer(self) -> None:
        """The writer thread: one transaction per batch (each record alone if one is malformed), and the
        log's checkpoints."""
        while (item := self._inbox.get()) is not None:
            if item == _CHECKPOINT:
                try:
                    self.store.checkpoint()
                except Exception:  # noqa: BLE001 - a later checkpoint (or write) tries again
                    log.exception("the trajectory store could not checkpoint its log")
                continue
            loop, batch = item
            errors = self._write(batch)
            try:
                loop.call_soon_threadsafe(self._landed, loop, batch, errors)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return

    def _write(self, batch: list[_Pending], wait: bool = True) -> list[Exception | None] | None:
        """Each record's outcome (None: stored). With `wait=False` (on the loop), None when the writer
        thread must take the batch: another writer holds the lock, or a record is malformed (the thread
        writes the others one by one)."""
        try:
            seqs = self.store.append_many([p.turn for p in batch], wait=wait)
        except StoreError as e:
            return [e] * len(batch)
        except ValueError:
            return self._write_one_by_one(batch) if wait else None
        except Exception as e:  # noqa: BLE001 - the writer (thread or loop) must survive anything; callers learn why
            log.exception("the trajectory store writer failed")
            return [StoreError(f"the trajectory store failed: {e!r}")] * len(batch)
        return None if seqs is None else [None] * len(batch)

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
                errors.append(StoreError(f"the trajectory store failed: {e!r}"))
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
