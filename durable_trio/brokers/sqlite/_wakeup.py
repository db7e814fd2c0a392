"""How the SQLite broker's waiters wake (``SqliteBroker.wait_for_work``).

:class:`WakeUps` is the broker's part that owns its waiters, by queue, and everything that
wakes them: the broker's own commits (:meth:`WakeUps.ring`, at once), the doorbell it owns
(rings from other processes, received in the doorbell's thread) and the tick the connection
thread runs while someone waits (other connections' commits, seen by ``PRAGMA data_version``).
The broker asks it; nothing else reads its tables.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import TYPE_CHECKING

import attrs
import trio

from ..._errors import StoreLost
from ..._sqlite import ConnectionThread, Doorbell
from . import _operations as ops

if TYPE_CHECKING:
    import sqlite3

__all__ = ["Waiter", "WakeUps"]


@attrs.define(eq=False)
class Waiter:
    """One task in :meth:`~durable_trio.brokers.sqlite.SqliteBroker.wait_for_work`."""

    queue: str
    event: trio.Event = attrs.Factory(trio.Event)
    data_version: int = -1
    """``PRAGMA data_version`` read just before this waiter's last look at its queue."""
    due: float | None = None
    """Wall-clock due time of the queue's earliest delayed job at that look."""
    limited: bool = False
    """Its queue had a fleet-wide limit at the last look: a lease ending here wakes it."""
    found_ready: bool = False
    """Set by a tick that saw work on the queue, or by a doorbell ring naming it: the waiter
    returns without looking again (its consumer's pop looks)."""


class WakeUps:
    """The waiters of one broker and what wakes them (see the module docstring).

    Args:
        connection: the broker's connection thread; its tick hook is set here.
        interval: the safety-net tick (seconds) while someone waits.
        path: the database file (the doorbell's folder sits beside it).
        doorbell: whether to ring and listen to the cross-process doorbell.
    """

    def __init__(
        self, connection: ConnectionThread, interval: float, path: str, *, doorbell: bool
    ) -> None:
        self._db = connection
        self._waiters: dict[str, set[Waiter]] = {}
        self._watched: tuple[Waiter, ...] = ()
        """Every waiter, copied on write: the connection thread's tick reads it unlocked."""
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self.doorbell: Doorbell | None = (
            Doorbell(path, self._on_doorbell, interested=self._waits_on) if doorbell else None
        )
        """The cross-process doorbell (``None``: opened with ``doorbell=False``)."""
        connection.set_tick_hook(self._tick, lambda: bool(self._watched), interval)

    def ring(self, queue: str) -> None:
        """After a commit that can make work ready on ``queue``: wake this broker's waiters
        (the other brokers' doorbells were rung by the connection thread after the commit)."""
        for waiter in self._waiters.get(queue, ()):
            waiter.event.set()

    def ring_freed(self, queue: str) -> None:
        """After a commit that ended leases on ``queue``: wake this broker's waiters of it if
        it is limited (a freed slot is work for them; other processes' waiters see the commit
        at their next tick). Nothing for an unlimited queue: a finish is no work there."""
        for waiter in self._waiters.get(queue, ()):
            if waiter.limited:
                waiter.event.set()

    def watch(self, waiter: Waiter, *, listen: bool = True) -> None:
        """Register ``waiter`` before its first look. The first waiter starts the tick and (if
        ``listen``: the broker is not closed) binds the doorbell's socket, so no ring slips by
        between the look and the wait."""
        self._trio_token = trio.lowlevel.current_trio_token()
        self._waiters.setdefault(waiter.queue, set()).add(waiter)
        was_idle = not self._watched
        self._watched = (*self._watched, waiter)
        if was_idle and not self._db.closed:
            if self.doorbell is not None and listen:
                self.doorbell.listen()  # before the waiter's first look: no ring slips by
            self._db.poke()  # the thread may sleep with nothing to do: start ticking

    def unwatch(self, waiter: Waiter) -> None:
        """Forget ``waiter`` (its wait is over); the last one stops the tick."""
        waiters = self._waiters.get(waiter.queue)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[waiter.queue]
        self._watched = tuple(w for w in self._watched if w is not waiter)

    def _waits_on(self, queues: frozenset[str] | None) -> bool:
        """(In the doorbell's thread.) Whether a waiter here waits on one of ``queues`` (any
        queue, for ``None``). Reads the copied-on-write tuple: a waiter that registers just
        after is woken by its own first look or by the next ring."""
        watched = self._watched
        if queues is None:
            return bool(watched)
        return any(waiter.queue in queues for waiter in watched)

    def _on_doorbell(self, queues: frozenset[str] | None) -> None:
        """In the doorbell's receiving thread: other brokers pushed onto ``queues`` (``None``:
        onto queues they could not name). Waiters of those queues return at once, without a
        look (their consumer's pop is the look; a spurious return is allowed); unnamed queues
        make the connection thread tick now."""
        trio_token = self._trio_token
        if queues is None or trio_token is None:
            self._db.tick_now()
            return
        with contextlib.suppress(trio.RunFinishedError):
            trio_token.run_sync_soon(self._wake, queues)

    def _wake(self, queues: frozenset[str]) -> None:
        for queue in queues:
            for waiter in self._waiters.get(queue, ()):
                waiter.found_ready = True
                waiter.event.set()

    def _tick(self, db: sqlite3.Connection) -> None:
        """In the connection thread, every ``wakeup_interval`` while someone waits: did another
        connection commit since each waiter looked? Only then look again at those waiters'
        queues, and hand the answers to :meth:`_apply_tick` in the Trio thread."""
        watched = self._watched
        trio_token = self._trio_token
        if not watched or trio_token is None:
            return
        if self.doorbell is not None:
            self.doorbell.check()  # our socket removed by someone: bind a new one
        try:
            if not self._db.check_identity(db):
                # The file is gone: nobody else will commit to this one. The waiters look
                # for themselves and their calls raise StoreLost.
                raise StoreLost(self._db.lost or "")
            version = ops.data_version(db)
            stale = {w.queue for w in watched if w.data_version != version}
            if not stale:
                return
            now = time.time()
            found = {queue: ops.probe_one(db, queue, now) for queue in stale}
            callback = partial(self._apply_tick, version, found)
        except Exception:
            # Let the waiters look for themselves: their own call raises the error.
            callback = partial(self._apply_tick, None, None)
        with contextlib.suppress(trio.RunFinishedError):
            trio_token.run_sync_soon(callback)

    def _apply_tick(
        self, version: int | None, found: dict[str, tuple[bool, float | None]] | None
    ) -> None:
        """Wake the waiters whose queue has work or whose earliest due time moved."""
        if version is None or found is None:
            for waiter in self._watched:
                waiter.event.set()
            return
        for queue, (ready, due) in found.items():
            for waiter in self._waiters.get(queue, ()):
                if ready or due != waiter.due:
                    waiter.found_ready = ready
                    waiter.event.set()
                else:
                    waiter.data_version = version
