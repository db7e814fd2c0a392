"""The nursery tree of a queue transport, whose nesting is its close order (T24, docs/spec.md).

::

    transport tree (one task in the transport's root nursery)
    └── keeper        the lease keeper: renews every open claim        left 5th, then handback (6)
        └── jobs      one job worker per running handler                left 4th (close_timeout)
            └── inboxes   this instance's reply / tenant-event inboxes  left 3rd
                └── vitals    concurrency controller, liveness timer    left 2nd (keys withdrawn)
                    └── consumers  every poll loop, the reclaim sweep   left 1st: intake stops

Each level is an ``async with`` of the part it holds (``LeaseKeeper.renewing``,
``JobRunner.serving``, ``Consumers.inbox_intake``, ``Vitals.beating``, ``Consumers.intake``),
and :meth:`TransportTree.run` nests them in that order. Leaving a level is a phase of the close,
run in that part's own exit, and each phase is bounded by the deadline of a scope its own level
owns: the consumers bound the pops in flight, liveness its last write and the
key removal, the jobs level waits ``close_timeout`` for its handlers, the keeper bounds its
round in flight. What runs after the tree is left (handing back the claims still open, then
draining this instance's own inboxes) is shielded and bounded by ``cleanup_timeout``. In
depth: docs/close.md.

The same unwinding runs when a loop fails (the failure cancels the tree from inside): every
level's phase sits in a ``finally`` of its part's exit, shielded, so claims are handed back
either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._consumers import Consumers
    from ._jobs import JobRunner
    from ._liveness import Vitals
    from ._options import TransportOptions
    from ._remote import RemoteProtocols
    from ._renewal import LeaseKeeper
    from ._sweep import Sweeper

__all__ = ["TransportTree"]


class TransportTree:
    """The tree of one transport: its parts' levels nested in close order. When :meth:`close`
    is asked it is left level by level (the close of T24), and :attr:`closed` is set once the
    cleanup after it is done."""

    def __init__(
        self,
        options: TransportOptions,
        report: Callable[[BaseException], None],
        *,
        keeper: LeaseKeeper,
        runner: JobRunner,
        consumers: Consumers,
        vitals: Vitals,
        sweeper: Sweeper | None,
        remote: RemoteProtocols,
    ) -> None:
        self._options = options
        self._report = report
        self._keeper = keeper
        self._runner = runner
        self._consumers = consumers
        self._vitals = vitals
        self._sweeper = sweeper
        self._remote = remote
        self._close_requested = trio.Event()
        self._task: trio.lowlevel.Task | None = None
        self.closed = trio.Event()
        """Set once the tree is left and the cleanup after it is done."""

    def close(self) -> None:
        """Start leaving the tree (:attr:`closed` is set once it is out)."""
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
            the same exits, each shielded and bounded.
        """
        self._task = trio.lowlevel.current_task()
        consumers = self._consumers
        try:
            async with (
                self._keeper.renewing(),  # left 5th: renewal stops
                self._runner.serving(),  # left 4th: the cancelled handlers end
                consumers.inbox_intake(self._runner),  # 3rd: handlers drain, own inboxes stop
                self._vitals.beating(),  # left 2nd: the liveness keys are withdrawn
                consumers.intake(self._sweeper),  # left 1st: no new work is taken
            ):
                task_status.started()
                await self._close_requested.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self._after()

    async def _after(self) -> None:
        """After the tree (close phases 6 and 7): hand back every claim still open (immediate,
        attempt-neutral), then withdraw the inbox registration and drain this instance's own
        inboxes, bounded. (Phase 8: the backend belongs to whoever opened it.)"""
        await self._runner.hand_back_open_claims()
        with trio.move_on_after(self._options.cleanup_timeout) as inboxes_bound:
            try:
                await self._remote.close_inboxes()
            except BrokerError as exc:
                self._report(exc)
        if inboxes_bound.cancelled_caught:
            self._report(BrokerError("close: draining this instance's inboxes timed out"))
        self.closed.set()
