"""Concurrency slots: N handlers at once for the price of ONE poll loop (T5, docs/spec.md), and
the gate that runs a suspect alone (docs/concepts.md, "A suspect runs alone")."""

from __future__ import annotations

import trio

__all__ = ["Slots"]


class Slots:
    """A counter of busy slots under a limit that may move (the adaptive controller moves it).

    Unlike a ``trio.Semaphore`` its limit can change while tasks wait: a raise wakes every waiter
    at once, a cut lets running work finish and simply takes no more until under the new limit.

    With ``isolate`` (the step handlers' slots), a *suspect* — a job that stalled before while
    its handler ran, perhaps because it kills whatever process runs it — runs alone: while one
    waits (:meth:`run_alone`) or runs, no slot is taken, and it starts only once every other
    slot is free. Innocent handlers then never die beside it.
    """

    def __init__(self, limit: int, *, isolate: bool = False) -> None:
        if limit < 1:
            raise ValueError(f"a concurrency limit must be at least 1, got {limit}")
        self.limit = limit
        """The slots at most (a field: read on every job's finalize; moved by
        :meth:`set_limit`)."""
        self.isolate = isolate
        self.in_flight = 0
        self._waiting = 0
        """Suspects waiting to run alone (each holds a slot meanwhile)."""
        self._alone = False
        """A suspect runs."""
        self._lot = trio.lowlevel.ParkingLot()

    def set_limit(self, value: int) -> None:
        """Move the limit: a raise wakes every waiter at once."""
        if value < 1:
            raise ValueError(f"a concurrency limit must be at least 1, got {value}")
        self.limit = value
        self._lot.unpark_all()

    @property
    def gated(self) -> bool:
        """A suspect waits or runs alone: no slot is taken."""
        return self._alone or self._waiting > 0

    async def acquire(self) -> None:
        """Take a slot, waiting while every slot is busy (or a suspect waits or runs).

        Cancellation: a cancelled wait takes no slot.
        """
        while self.in_flight >= self.limit or self._alone or self._waiting:
            await self._lot.park()
        self.in_flight += 1

    def take_free(self, most: int) -> int:
        """Take up to ``most`` more slots at once, without waiting; returns how many."""
        if self._alone or self._waiting:
            return 0
        taken = max(0, min(most, self.limit - self.in_flight))
        self.in_flight += taken
        return taken

    def release(self, count: int = 1) -> None:
        self.in_flight -= count
        if self._lot:  # nobody parked is the common case: skip the unpark machinery
            if self._waiting:
                self._lot.unpark_all()  # (a suspect may be among them)
            else:
                self._lot.unpark(count=count)

    async def run_alone(self) -> None:
        """Wait, holding a slot, until every other slot is free and no other suspect runs;
        then this one runs alone until :meth:`end_alone`. No slot is taken meanwhile.

        Cancellation: a cancelled wait leaves the gate as it found it (the caller still holds
        its slot, and releases it as usual).
        """
        self._waiting += 1
        try:
            while self._alone or self.in_flight > self._waiting:
                await self._lot.park()
        except BaseException:
            self._waiting -= 1
            self._lot.unpark_all()  # (the gate may be open again)
            raise
        self._waiting -= 1
        self._alone = True

    def end_alone(self) -> None:
        """The suspect that ran alone ended (before it releases its slot)."""
        self._alone = False
        self._lot.unpark_all()
