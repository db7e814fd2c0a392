"""The nursery tree of a queue transport, whose nesting is its close order (T24, docs/spec.md).

::

    transport tree (one task in the transport's root nursery)
    └── keeper        the lease keeper: renews every open claim        left 5th, then handback (6)
        └── jobs      one job worker per running handler                left 4th (close_timeout)
            └── inboxes   this instance's reply / tenant-event inboxes  left 3rd
                └── vitals    concurrency controller, liveness timer    left 2nd (keys withdrawn)
                    └── consumers  every poll loop, the reclaim sweep   left 1st: intake stops

Leaving a level is a phase of the close, and each phase is bounded by the deadline of a scope
its own level owns: the consumers bound the pops in flight, liveness its last write and the
key removal, the jobs level waits ``close_timeout`` for its handlers, the keeper bounds its
round in flight. What runs after the tree is left (handing back the claims still open, then
draining this instance's own inboxes) is shielded and bounded by ``cleanup_timeout``. In
depth: docs/close.md.

The same unwinding runs when a loop fails (the failure cancels the tree from inside): every
level's phase sits in a ``finally``, shielded, so claims are handed back either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError
from ._claims import Level

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._adaptive import ConcurrencyController
    from ._jobs import JobRunner
    from ._leases import LeaseKeeper, Sweeper
    from ._liveness import Liveness
    from ._options import TransportOptions

__all__ = ["TransportTree"]


class TransportTree:
    """Builds the tree of one transport and, when :meth:`close` is asked, leaves it level by
    level (the close of T24)."""

    def __init__(self, options: TransportOptions, report: Callable[[BaseException], None]) -> None:
        self._options = options
        self._report = report
        self.consumers = Level("consumers")
        self.inboxes = Level("inboxes")
        self.jobs = Level("jobs")
        self.keeper = Level("keeper")
        self.vitals = Level("vitals")
        self._close_requested = trio.Event()
        self._task: trio.lowlevel.Task | None = None

    def attach(
        self,
        *,
        runner: JobRunner,
        keeper: LeaseKeeper | None,
        sweeper: Sweeper | None,
        controller: ConcurrencyController,
        liveness: Callable[[], Liveness | None],
        stop_intake: Callable[..., None],
        begin_close: Callable[[], None],
        close_inboxes: Callable[[], Awaitable[None]],
        closed: Callable[[], None],
    ) -> None:
        """The parts whose tasks the levels hold (``liveness`` is read when used: a tenant
        pod sets it up late) and the transport's own steps of the close."""
        self._runner = runner
        self._lease_keeper = keeper
        self._sweeper = sweeper
        self._controller = controller
        self._liveness = liveness
        self._stop_intake = stop_intake
        self._begin_close = begin_close
        self._close_inboxes = close_inboxes
        self._closed = closed

    def close(self) -> None:
        """Start leaving the tree (its task sets the transport's ``closed`` once it is out)."""
        self._close_requested.set()

    def holds_current_task(self) -> bool:
        """Whether the calling task runs inside the tree (a handler): such a task must not wait
        for the close, which waits for it."""
        task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        while task is not None:
            if task is self._task:
                return True
            nursery = task.parent_nursery
            task = None if nursery is None else nursery.parent_task
        return False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The whole tree, from its start to the end of the close.

        Cancellation:
            A cancellation from outside (a failed loop, the root cancelled) unwinds it through
            the same phases, each shielded and bounded.
        """
        self._task = trio.lowlevel.current_task()
        cleanup = self._options.cleanup_timeout
        try:
            async with trio.open_nursery() as keeper:
                self.keeper.nursery = keeper
                if self._lease_keeper is not None:
                    await keeper.start(self._lease_keeper.run)
                try:
                    await self._jobs_level(task_status)
                finally:
                    # 5. stop renewal; the round in flight is shielded and lands first, bounded
                    if self._lease_keeper is not None:
                        self._lease_keeper.stop(trio.current_time() + cleanup)
                    keeper.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                # 6. hand back every claim still open: immediate and attempt-neutral
                await self._runner.hand_back_open_claims()
                # 7. withdraw the inbox registration, drain this instance's own inboxes
                with trio.move_on_after(cleanup) as inboxes_bound:
                    try:
                        await self._close_inboxes()
                    except BrokerError as exc:
                        self._report(exc)
                if inboxes_bound.cancelled_caught:
                    self._report(BrokerError("close: draining this instance's inboxes timed out"))
                # 8. the backend belongs to whoever opened it and is closed by them
                self._closed()

    async def _jobs_level(self, task_status: trio.TaskStatus[None]) -> None:
        options = self._options
        async with trio.open_nursery() as jobs:
            self.jobs.nursery = jobs
            bound = trio.current_time()
            try:
                async with trio.open_nursery() as inboxes:
                    self.inboxes.nursery = inboxes
                    try:
                        await self._vitals_level(task_status)
                    finally:
                        with trio.CancelScope(shield=True):
                            # 3. running handlers finish, up to close_timeout, still renewed
                            with trio.move_on_after(options.close_timeout):
                                await self._runner.idle.wait_value(True)
                            # 4. cancel what still runs (each keeps its claim for the handback)
                            # and stop this instance's own inboxes; both bounded by one deadline
                            self._runner.abandon_running()
                            bound = trio.current_time() + options.cleanup_timeout
                            self._stop_intake(bound, inbox=True)
                            inboxes.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    with trio.move_on_at(bound):
                        await self._runner.idle.wait_value(True)
                    jobs.cancel_scope.cancel()

    async def _vitals_level(self, task_status: trio.TaskStatus[None]) -> None:
        async with trio.open_nursery() as vitals:
            self.vitals.nursery = vitals
            await vitals.start(self._controller.run)
            liveness = self._liveness()
            if liveness is not None:
                await vitals.start(liveness.run)
            try:
                async with trio.open_nursery() as consumers:
                    self.consumers.nursery = consumers
                    try:
                        if self._sweeper is not None:
                            await consumers.start(self._sweeper.run)
                        task_status.started()
                        await self._close_requested.wait()
                    finally:
                        # 1. stop taking work: the pops and finalizes in flight land by bound
                        self._begin_close()
                        self._stop_intake(trio.current_time() + self._options.cleanup_timeout)
                        consumers.cancel_scope.cancel()
            finally:
                # 2. stop the controller and the heartbeat timer; withdraw the liveness keys
                liveness = self._liveness()
                if liveness is not None:
                    await liveness.withdraw(self._options.cleanup_timeout)
                vitals.cancel_scope.cancel()
