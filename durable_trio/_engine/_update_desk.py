"""The engine's update desk: it starts a run's update serving only once the run may have a
request (issue 34's updates, :mod:`._updates`).

Nearly every run takes no update. A run created here was watched from before its create
(``NewRunWatch``): a request, stored only for a run that exists, rings the run's key, so until
that ring nothing can be waiting for it. Such a run's servant is *dormant*: no task, no read;
the desk (one per engine) starts its serving (:meth:`UpdateServant.serve`, a task in the
engine's runs nursery, cancelled when the run's driver ends) at the first of:

* a ring of the run's key (the desk follows every ring of the store), or a ring that may have
  been lost (every dormant run then);
* a request found by the safety net's reads, which the desk makes for it (a ring lost on the
  way): :data:`~._updates.UPDATE_POLL` seconds after the run began, then after twice as long
  each time none is found, up to :data:`~._updates.UPDATE_QUIET_MAX` (the serving's own
  schedule); each read a short task of its own;
* the run's new watch found rung already when its driver began.

A run not created here (taken over, resumed, a store that does not ring) is served from its
start, as before. A burst of runs that end within a second costs no task and no read for
their updates, and a burst of longer ones holds no task for them between their reads
(docs/benchmarks.md, "The engine's burst of runs and the garbage collector").
"""

from __future__ import annotations

import heapq
import itertools
from functools import partial
from typing import TYPE_CHECKING

import trio

from ._context import UPDATE_LOG
from ._stores._wakes import wakes_of
from ._updates import UPDATE_POLL, UPDATE_QUIET_MAX

if TYPE_CHECKING:
    from ._stores import RunStore
    from ._updates import UpdateServant

__all__ = ["UpdateDesk"]


class UpdateDesk:
    """Starts the runs' update serving when needed (see the module docstring).

    Args:
        store: the engine's run store.
    """

    def __init__(self, store: RunStore) -> None:
        self._store = store
        self._dormant: dict[str, UpdateServant] = {}
        self._due: list[tuple[float, int, str, float]] = []
        """The dormant runs' safety-net reads: (when due, order, run id, the interval that led
        to it), a heap."""
        self._order = itertools.count()
        self._added = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._waiting: list[UpdateServant] = []
        """Servants to serve once :meth:`run` has begun (drivers begun before it)."""

    @property
    def dormant(self) -> int:
        """Runs whose updates are not served yet (statistics, tests)."""
        return len(self._dormant)

    def begin(self, servant: UpdateServant) -> None:
        """``servant``'s driver begins: dormant if its run was watched from before its
        create, else served now."""
        fresh = servant.fresh
        if fresh is None or fresh[1].is_set():
            self._serve(servant)
            return
        self._dormant[servant.run_id] = servant
        self._read_after(servant.run_id, UPDATE_POLL)

    def _read_after(self, run_id: str, interval: float) -> None:
        """A safety-net read of dormant ``run_id``'s requests in ``interval`` seconds."""
        entry = (trio.current_time() + interval, next(self._order), run_id, interval)
        if not self._due or entry < self._due[0]:
            self._added.set()
        heapq.heappush(self._due, entry)

    def end(self, servant: UpdateServant) -> None:
        """``servant``'s driver ended: its serving stops (idempotent)."""
        if self._dormant.get(servant.run_id) is servant:
            del self._dormant[servant.run_id]
        servant.stop_serving()

    def _wake(self, run_id: str | None) -> None:
        """A ring of ``run_id`` (``None``: rings may have been lost): serve the dormant runs
        it concerns."""
        if run_id is None:
            woken = list(self._dormant.values())
            self._dormant.clear()
        else:
            servant = self._dormant.pop(run_id, None)
            woken = [] if servant is None else [servant]
        for servant in woken:
            self._serve(servant)

    def _serve(self, servant: UpdateServant) -> None:
        if self._nursery is None:
            self._waiting.append(servant)
            return
        scope = servant.serving_scope()
        if scope is not None:
            self._nursery.start_soon(servant.serve_within, scope)

    async def run(self, runs: trio.Nursery | None) -> None:
        """Serve into ``runs`` (the engine's runs nursery, running: its loops nursery, where
        this runs, is inside it), follow the store's rings and run the safety net's first
        reads, until cancelled (the engine closing)."""
        assert runs is not None
        self._nursery = runs
        waiting, self._waiting = self._waiting, []
        for servant in waiting:
            self._serve(servant)
        wakes = wakes_of(self._store)
        stop = None if wakes is None else wakes.follow(self._wake)
        try:
            for servant in list(self._dormant.values()):  # rung before the desk followed
                fresh = servant.fresh
                if fresh is not None and fresh[1].is_set():
                    self._wake(servant.run_id)
            due = self._due
            while True:
                if not due or trio.current_time() < due[0][0]:
                    self._added = trio.Event()
                    with trio.move_on_at(due[0][0] if due else float("inf")):
                        await self._added.wait()
                    continue
                _, _, run_id, interval = heapq.heappop(due)
                sleeping = self._dormant.get(run_id)
                if sleeping is not None:
                    runs.start_soon(self._read, sleeping, interval)
        finally:
            if stop is not None:
                stop()
            self._nursery = None

    async def _read(self, servant: UpdateServant, interval: float) -> None:
        """One safety-net read of dormant ``servant``'s requests: served if one is there, else
        read again after twice ``interval`` (a ring meanwhile serves it: the desk follows)."""
        services = servant.services
        text = await services.guard(
            partial(services.store.read_signal, servant.run_id, UPDATE_LOG, 1), "reading"
        )
        if self._dormant.get(servant.run_id) is not servant:
            return  # served meanwhile, or ended
        if text is not None:
            self._wake(servant.run_id)
        else:
            self._read_after(servant.run_id, min(interval * 2, UPDATE_QUIET_MAX))
