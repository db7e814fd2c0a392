"""Starting the debounced runs that are due (issue 33, item 4; docs/concurrency.md, "Debounce
and dedup keys").

A debounced start (``engine.start(..., debounce=)``) is a row of the run store until it is due
(:meth:`RunStore.debounce_run`); every engine that reconciles runs :class:`DebouncedStarts`'s
loop, which sleeps until the soonest start due and creates its run (pending, no owner; the
store's :meth:`~RunStore.start_debounced`, atomic per start), then takes it over (reconcile).
A start recorded by an engine that died is started by any other, as an orphaned run is
taken over: the loop re-reads the store at least every ``recheck`` seconds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._records import RunRecord
    from ._stores import RunStore

__all__ = ["START_BATCH", "DebouncedStarts"]

#: Debounced starts created per store call.
START_BATCH = 100


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

    def due(self, at: float | None) -> None:
        """A start of this engine is due at ``at``: wake the loop if that is sooner than it
        knows of."""
        if at is not None and at < self._next:
            self._next = at
            self._bell.set()

    async def run(self) -> None:
        """Start the due debounced runs, until cancelled."""
        store = self._store
        trio_clock = getattr(store, "trio_clock", False)
        while True:
            self._bell = trio.Event()
            try:
                runs, soonest = await store.start_debounced(START_BATCH)
            except BrokerError as exc:
                self._report(exc)
                runs, soonest = [], None
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
