"""Concurrency slots: N handlers at once for the price of ONE poll loop (T5, docs/spec.md)."""

from __future__ import annotations

import trio

__all__ = ["Slots"]


class Slots:
    """A counter of busy slots under a limit that may move (the adaptive controller moves it).

    Unlike a ``trio.Semaphore`` its limit can change while tasks wait: a raise wakes every waiter
    at once, a cut lets running work finish and simply takes no more until under the new limit.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a concurrency limit must be at least 1, got {limit}")
        self._limit = limit
        self.in_flight = 0
        self._lot = trio.lowlevel.ParkingLot()

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"a concurrency limit must be at least 1, got {value}")
        self._limit = value
        self._lot.unpark_all()

    async def acquire(self) -> None:
        """Take a slot, waiting while every slot is busy.

        Cancellation: a cancelled wait takes no slot.
        """
        while self.in_flight >= self._limit:
            await self._lot.park()
        self.in_flight += 1

    def take_free(self, most: int) -> int:
        """Take up to ``most`` more slots at once, without waiting; returns how many."""
        taken = max(0, min(most, self._limit - self.in_flight))
        self.in_flight += taken
        return taken

    def release(self, count: int = 1) -> None:
        self.in_flight -= count
        if self._lot:  # nobody parked is the common case: skip the unpark machinery
            self._lot.unpark(count=count)
