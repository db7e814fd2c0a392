"""Starting the debounced runs that are due (issue 33, item 4; docs/concurrency.md, "Debounce
and dedup keys").

A debounced start (``engine.start(..., debounce=)``) is a row of the run store until it is due
(:meth:`RunStore.debounce_run`); every engine that reconciles runs :class:`DebouncedStarts`'s
loop, which sleeps until the soonest start due and creates its run (pending, no owner; the
store's :meth:`~RunStore.start_debounced`, atomic per start), then takes it over (reconcile).
A new start recorded by any process rings the run store (:data:`DEBOUNCED`), and every loop
reads when it is due at once; a start recorded by an engine that died (or whose ring was lost)
is started by any other, as an orphaned run is taken over: the loop re-reads the store at least
every ``recheck`` seconds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError
from ._stores._wakes import DEBOUNCED, following

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._records import RunRecord
    from ._stores import RunStore

__all__ = ["RUNG_GAP", "START_BATCH", "DebouncedStarts"]

#: Debounced starts created per store call.
START_BATCH = 100

#: Seconds between two reads of the pending starts that rings ask for, at least: a burst of
#: debounced starts elsewhere (one ring each) costs each engine a read per gap, not per start.
RUNG_GAP = 0.05


class DebouncedStarts:
    """The loop that starts due debounced runs, for one engine.

    Args:
        store: the run store.
        recheck: seconds between two reads of the store at most (starts other engines
            recorded).
        started: called with each run created here (counted, its ``started`` event).
        reconcile: takes over the runs created (and any other orphan).
        report: the engine's error hook (a store error: the loop tries again).
    """

    def __init__(
        self,
        store: RunStore,
        recheck: float,
        *,
        started: Callable[[RunRecord], None],
        reconcile: Callable[[], Awaitable[object]],
        report: Callable[[BaseException], None],
    ) -> None:
        self._store = store
        self._recheck = recheck
        self._started = started
        self._reconcile = reconcile
        self._report = report
        self._next = math.inf  # when the soonest start this loop knows of is due (store clock)
        self._bell = trio.Event()
        self._rung = False  # the bell was rung by the store (a start recorded elsewhere)

    def due(self, at: float | None) -> None:
        """A start of this engine is due at ``at``: wake the loop if that is sooner than it
        knows of."""
        if at is not None and at < self._next:
            self._next = at
            self._bell.set()

    async def run(self) -> None:
        """Start the due debounced runs, until cancelled."""
        with following(self._store, DEBOUNCED, self._rang):  # (a start recorded elsewhere)
            await self._run()

    def _rang(self) -> None:
        """The store rang: read the pending starts now (within ``RUNG_GAP`` of the last read)."""
        self._rung = True
        self._bell.set()

    async def _run(self) -> None:
        store = self._store
        trio_clock = getattr(store, "trio_clock", False)
        read_at = -math.inf
        while True:
            if self._rung:
                self._rung = False
                await trio.sleep_until(read_at + RUNG_GAP)
            read_at = trio.current_time()
            self._bell = trio.Event()
            try:
                runs, soonest = await store.start_debounced(START_BATCH)
            except (BrokerError, ValueError, TypeError, ArithmeticError) as exc:
                # (a store's error, or a stored value no store check foresaw: reported, and
                # the loop reads again at its next recheck; it never dies of bad data)
                self._report(exc)
                runs, soonest = [], None
            if soonest is not None and soonest != soonest:  # (NaN: no time, never a wake-up)
                soonest = None
            for run in runs:
                self._started(run)
            if runs:
                try:
                    await self._reconcile()
                except BrokerError as exc:
                    self._report(exc)  # the periodic reconcile takes them
            if len(runs) == START_BATCH:
                continue
            self._next = math.inf if soonest is None else soonest
            now = trio.current_time()
            wake = now + self._recheck
            if soonest is not None:
                # The store's clock is trio's (the memory store, a test's): its exact time.
                at = soonest if trio_clock else now + max(0.0, soonest - store.now())
                wake = min(wake, at)
            with trio.move_on_at(wake):
                await self._bell.wait()
