"""The engine's nursery tree: where its drivers and loops live, and how it closes.

::

    tree (one task in open_engine's nursery, from the engine's start to the end of its close)
    └── runs      one driver task per run this engine drives (._runtime, ._remote_run)
        └── loops   lease renewal, reconcile, the store watch (._timers), the step watch,
                    the loss audit, schedules, cancel delivery, heartbeats, the control plane

The engine starts its pieces in the nurseries the tree lends it (``Engine._start``, run by
``open_engine``'s task, so a failure to start leaves bare, as the body's does). The close is the
unwinding of that nesting, innermost first, each level shielded and bounded: (1) the loops
are cancelled and (2) every run's driver with them, where it waits (its checkpoints are already
stored), at the same instant, as the close always did; the loops level is left, then the runs
level waits for its drivers, up to ``cleanup_timeout``, and (3) releases the runs still in
flight so another engine takes them over at once (bounded by ``cleanup_timeout``), then (4)
removes the engine's key (._advert; bounded by ``cleanup_timeout``). The close
begins when :meth:`EngineTree.close` asks for it (``Engine.aclose``), or when a cancel or a
failure reaches the tree from outside; :attr:`EngineTree.closed` is set once it is over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError
from ._stores._wakes import STARTS, ring

if TYPE_CHECKING:
    from ._advert import EngineAdvert
    from ._drivers import Drivers
    from ._services import EngineServices

__all__ = ["EngineTree"]


class EngineTree:
    """The runs and loops nurseries of one engine, and its close.

    Args:
        drivers: the engine's drivers (their owner: the close cancels them, waits for them and
            takes the runs still in flight from it).
        services: the engine's services (its store, its options, its error hook).
        advert: the engine's key (removed last).
    """

    def __init__(self, drivers: Drivers, services: EngineServices, advert: EngineAdvert) -> None:
        self._drivers = drivers
        self._services = services
        self._advert = advert
        self._close_asked = trio.Event()
        self._loops: trio.Nursery | None = None
        self._in_flight: list[str] | None = None
        self._task: trio.lowlevel.Task | None = None
        self.runs: trio.Nursery | None = None
        """Where the drivers run (``None`` before the tree runs)."""
        self.closing = False
        """The close was asked for, or began: no new run is started or taken over."""
        self.closed = trio.Event()
        """Set once the close is over (every level left)."""

    def close(self) -> None:
        """Ask for the close: the loops and the drivers are cancelled now, where they wait;
        :meth:`run`'s task waits for them and releases the runs (:attr:`closed` says when)."""
        self.closing = True
        self._close_asked.set()
        self._cancel()

    def _cancel(self) -> None:
        if self._in_flight is not None or self._loops is None or self.runs is None:
            return  # cancelled already, or not running (run's own finally cancels then)
        # 1. stop the loops
        self._loops.cancel_scope.cancel()
        # 2. cancel every run's driver where it waits (with the loops: as the close always did);
        # what is still owned here is released in 3 (Drivers.cancel_all)
        self._in_flight = self._drivers.cancel_all(
            trio.current_time() + self._services.options.cleanup_timeout
        )
        self.runs.cancel_scope.cancel()

    @property
    def running(self) -> bool:
        """Whether :meth:`run` began (a tree that never ran has nothing to close)."""
        return self._task is not None

    def holds_current_task(self) -> bool:
        """Whether the calling task runs inside the tree (a driver, a loop): such a task must
        not wait for the close, which waits for it."""
        task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        while task is not None:
            if task is self._task:
                return True
            nursery = task.parent_nursery
            task = None if nursery is None else nursery.parent_task
        return False

    async def run(self, *, task_status: trio.TaskStatus[trio.Nursery]) -> None:
        """The whole tree: open the runs and loops nurseries (started: the loops nursery), wait
        for the close to be asked, then unwind.

        Cancellation:
            A cancellation from outside (the caller's block cancelled, a failed piece) unwinds
            it through the same levels, each shielded and bounded.
        """
        self._task = trio.lowlevel.current_task()
        try:
            async with trio.open_nursery() as runs:
                self.runs = runs
                try:
                    async with trio.open_nursery() as loops:
                        self._loops = loops
                        try:
                            task_status.started(loops)
                            await self._close_asked.wait()
                        finally:
                            self.closing = True
                            self._cancel()  # 1. and 2., unless close() did already
                finally:
                    with trio.CancelScope(shield=True):
                        await self._stop_runs(self._in_flight or [])
        finally:
            self.closing = True
            self.closed.set()

    async def _stop_runs(self, in_flight: list[str]) -> None:
        services = self._services
        options = services.options
        # 2. (continued) wait for the drivers to stop, bounded
        with trio.move_on_after(options.cleanup_timeout):
            await self._drivers.wait_stopped()
        # 3. release the runs still in flight: another engine takes them over at once
        in_flight = list(dict.fromkeys([*in_flight, *self._drivers.left_over()]))
        if options.release_on_close and in_flight:
            with trio.move_on_after(options.cleanup_timeout):
                try:
                    await services.store.release_runs(options.engine_id, in_flight)
                    await ring(services.store, STARTS)  # (the others look now)
                except BrokerError as exc:
                    services.report(exc)
        # 4. the engine's key: the fleet sees it gone at once, not after its time-to-live
        await self._advert.withdraw(options.cleanup_timeout)
