"""Recording finished requests: durably first, then into the session's tree.

A request becomes visible (in its session's tree, to later turns, to readers) only after its record is
committed to the store, so a failed write leaves nothing behind and the session goes on from what is
stored: when the disk has room again, the next turn works. The record is planned against the tree as it
is (`PrefixTree.plan`: the longest stored prefix and the request it belongs to), which stays a valid
anchor however many inserts land before it, since the tree only grows.

Group commit: records that finish while a write is under way are written together in the next
transaction, in the order they finished, and inserted into their trees in that same order (the order in
which the store replays them). Writes run in a worker thread; the event loop never waits on SQLite.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from reference.manager.prefix_tree import InsertResult
from reference.manager.sessions import Session
from reference.manager.store import NewTurn, StoreError, TrajectoryStore

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    session: Session
    turn: NewTurn
    prompt: Sequence[int]
    done: asyncio.Future


class Recorder:
    def __init__(self, store: TrajectoryStore) -> None:
        self.store = store
        self._pending: list[_Pending] = []
        self._writer: asyncio.Task | None = None
        self.committed = 0
        self.failed = 0
        self.last_failure: str | None = None  # the last write's error, until a write succeeds again
        self.last_failure_s: float | None = None

    async def record(self, session: Session, turn: NewTurn, prompt: Sequence[int]) -> InsertResult:
        """Store `turn` durably, then insert it into `session.tree`; StoreError if the store failed (then
        nothing was recorded). The write completes even if the caller is cancelled meanwhile."""
        done = asyncio.get_running_loop().create_future()
        session.in_flight += 1  # held in memory until its record lands (released by the caller's table)
        self._pending.append(_Pending(session, turn, prompt, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_pending())
        return await asyncio.shield(done)

    def problem(self) -> str | None:
        """Why writes are failing now, or None."""
        return self.store.problem() or self.last_failure

    async def _write_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            errors = await self._write(batch)
            for item, error in zip(batch, errors, strict=True):
                item.session.in_flight -= 1
                if error is not None:
                    item.done.set_exception(error)
                    continue
                t = item.turn
                try:
                    result = item.session.tree.insert(item.prompt, t.token_ids, t.logprobs, t.versions, t.request_id)
                except Exception as e:  # noqa: BLE001 - stored but not in memory: the caller learns why
                    log.exception("request %s is stored but could not join its tree", t.request_id)
                    item.done.set_exception(e)
                    continue
                item.done.set_result(result)

    async def _write(self, batch: list[_Pending]) -> list[Exception | None]:
        """One transaction for the batch; if a record is malformed, each on its own."""
        try:
            await asyncio.to_thread(self.store.append_many, [p.turn for p in batch])
            errors: list[Exception | None] = [None] * len(batch)
        except StoreError as e:
            errors = [e] * len(batch)
        except ValueError:
            errors = []
            for p in batch:
                try:
                    await asyncio.to_thread(self.store.append_many, [p.turn])
                    errors.append(None)
                except (StoreError, ValueError) as e:
                    errors.append(e)
        failures = [e for e in errors if isinstance(e, StoreError)]
        self.committed += errors.count(None)
        self.failed += len(batch) - errors.count(None)
        if failures:
            self.last_failure, self.last_failure_s = str(failures[-1]), time.time()
            log.error("the trajectory store failed to record %d request(s): %s", len(failures), failures[-1])
        elif errors.count(None):
            self.last_failure = None
        return errors
