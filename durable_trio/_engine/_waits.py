"""What one engine's pieces wait on, each with its one owner: the remote steps its drivers wait
on (:class:`StepWaiters`), the step results being applied here (:class:`Applying`), and the
remote runs whose decisions are being applied here (:class:`DecisionLocks`).

The engine makes one of each before its services and hands them to the services
(:class:`~._services.EngineServices`), which lend them to every piece. Each table changes only
through its owner's methods; the other pieces read it.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from ._records import StepState

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, ItemsView

    from ._records import StepRecord

__all__ = ["Applying", "DecisionLocks", "StepWaiter", "StepWaiters"]

#: A step's key: ``(run_id, step_id)``.
StepKey = tuple[str, str]


def _newer(candidate: StepRecord, current: StepRecord | None) -> bool:
    if current is None:
        return True
    if candidate.attempt != current.attempt:
        return candidate.attempt > current.attempt
    return current.status is StepState.PENDING and candidate.status is not StepState.PENDING


class StepWaiter:
    """A remote step the engine waits on: result application (or the store watch) feeds it
    newer states of the checkpoint; it wakes its driver once the step is settled."""

    __slots__ = ("_event", "record", "since")

    def __init__(self) -> None:
        self.record: StepRecord | None = None
        self._event = trio.Event()
        self.since = trio.current_time()
        """When the engine started waiting (the watch skips waiters younger than a tick)."""

    def update(self, record: StepRecord) -> None:
        """Take ``record`` if it is newer than what the waiter holds."""
        if _newer(record, self.record):
            self.record = record
            if record.status is not StepState.PENDING:
                self._event.set()

    def beat(self, record: StepRecord) -> None:
        """Take ``record``, the held pending attempt with a heartbeat recorded (the same
        attempt, still pending: nothing to wake)."""
        held = self.record
        if held is not None and held.attempt == record.attempt and held.status is StepState.PENDING:
            self.record = record

    async def wait(self) -> StepRecord:
        """Until the step is settled; returns its final checkpoint."""
        await self._event.wait()
        assert self.record is not None
        return self.record


class StepWaiters:
    """The remote steps this engine's drivers wait on, by ``(run_id, step_id)``: a driver
    watches a step while it waits on it (:meth:`watch`, :meth:`unwatch`); result application,
    the store watch and the heartbeats feed the waiters they find (:meth:`get`)."""

    def __init__(self) -> None:
        self._waiters: dict[StepKey, StepWaiter] = {}

    def watch(self, key: StepKey) -> StepWaiter:
        """The waiter of step ``key``, made if there is none."""
        waiter = self._waiters.get(key)
        if waiter is None:
            waiter = self._waiters[key] = StepWaiter()
        return waiter

    def unwatch(self, key: StepKey, waiter: StepWaiter) -> None:
        """Stop waiting on ``key`` (if ``waiter`` is still its waiter)."""
        if self._waiters.get(key) is waiter:
            del self._waiters[key]

    def get(self, key: StepKey) -> StepWaiter | None:
        """The waiter of step ``key``, if a driver waits on it here."""
        return self._waiters.get(key)

    def items(self) -> ItemsView[StepKey, StepWaiter]:
        """Every step waited on, with its waiter."""
        return self._waiters.items()

    def __len__(self) -> int:
        return len(self._waiters)


class Applying:
    """The steps whose result this engine is applying now (checkpoint, then retry dispatch),
    by ``(run_id, step_id)``; each one's event is set once that application ended. The result
    handler begins and ends them; a driver, the loss audit or a heartbeat meeting one waits it
    out or leaves the step alone."""

    def __init__(self) -> None:
        self._applying: dict[StepKey, trio.Event] = {}

    def begin(self, key: StepKey) -> trio.Event:
        """A result of step ``key`` is being applied: copies arriving meanwhile wait for the
        returned event (hand it to :meth:`end`)."""
        done = self._applying[key] = trio.Event()
        return done

    def end(self, key: StepKey, done: trio.Event) -> None:
        """The application that :meth:`begin` returned ``done`` for ended."""
        if self._applying.get(key) is done:
            del self._applying[key]
        done.set()

    def get(self, key: StepKey) -> trio.Event | None:
        """The event of the application of step ``key`` under way, if one is."""
        return self._applying.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._applying

    def __len__(self) -> int:
        return len(self._applying)


class DecisionLocks:
    """The remote runs whose decisions are being applied here, one at a time per run, by run
    id: a run's lock exists while someone holds or awaits it, and whoever releases it last
    drops it (so none outlives its run)."""

    def __init__(self) -> None:
        self._locks: dict[str, trio.Lock] = {}

    @asynccontextmanager
    async def holding(self, run_id: str) -> AsyncIterator[None]:
        """Hold ``run_id``'s lock (made if there is none) for the block."""
        lock = self._locks.get(run_id)
        if lock is None:
            lock = self._locks[run_id] = trio.Lock()
        try:
            async with lock:
                yield
        finally:
            self._forget_idle(run_id, lock)

    async def wait_out(self, run_id: str) -> None:
        """Until no decision of ``run_id`` is being applied here (at once if none is)."""
        lock = self._locks.get(run_id)
        if lock is not None:
            try:
                async with lock:
                    pass
            finally:
                self._forget_idle(run_id, lock)

    def _forget_idle(self, run_id: str, lock: trio.Lock) -> None:
        """Drop a run's lock once nobody holds or awaits it. Whoever releases it last checks:
        a release hands the lock to the next waiter, so the first holder finds it still
        locked, and a lock left behind would outlive its run."""
        if (
            not lock.locked()
            and not lock.statistics().tasks_waiting
            and self._locks.get(run_id) is lock
        ):
            del self._locks[run_id]

    def get(self, run_id: str) -> trio.Lock | None:
        """``run_id``'s lock, if a decision of it is being applied (or awaited) here."""
        return self._locks.get(run_id)

    def __len__(self) -> int:
        return len(self._locks)
