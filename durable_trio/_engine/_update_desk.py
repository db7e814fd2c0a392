"""The engine's update desk: it starts a run's update serving only once the run may have a
request (issue 34's updates, :mod:`._updates`).

Nearly every run takes no update. A run created here was watched from before its create
(``NewRunWatch``): a request, stored only for a run that exists, rings the run's key, so until
that ring nothing can be waiting for it. Such a run's servant is *dormant*: no task, no read;
the desk (one per engine) starts its serving (:meth:`UpdateServant.serve`, a task in the
engine's runs nursery, cancelled when the run's driver ends) at the first of:

* a ring of the run's key (the desk follows every ring of the store), or a ring that may have
  been lost (every dormant run then);
* the safety net's first read, :data:`~._updates.UPDATE_POLL` seconds after the run began (a
  ring lost on the way: the serving then polls as before, backing off while nothing comes);
* the run's new watch found rung already when its driver began.

A run not created here (taken over, resumed, a store that does not ring) is served from its
start, as before. A burst of runs that end within a second costs no task and no read for
their updates (docs/benchmarks.md, "The engine's burst of runs and the garbage collector").
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import trio

from ._stores._wakes import wakes_of
from ._updates import UPDATE_POLL

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
        self._due: deque[tuple[float, str]] = deque()
        """(when its first safety-net read is due, run id), in that order (one interval for
        every run: appended in time order)."""
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
        if not self._due:
            self._added.set()
        self._due.append((trio.current_time() + UPDATE_POLL, servant.run_id))

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
                if not due:
                    self._added = trio.Event()
                    await self._added.wait()
                    continue
                at, run_id = due[0]
                if trio.current_time() < at:
                    await trio.sleep_until(at)
                    continue
                due.popleft()
                if run_id in self._dormant:
                    self._wake(run_id)
        finally:
            if stop is not None:
                stop()
            self._nursery = None
