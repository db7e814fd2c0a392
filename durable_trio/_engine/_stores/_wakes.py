"""Wakes: a run store's word that something a waiter waits on changed (issue 18).

A workflow blocked in ``ctx.wait_signal``, a caller in ``engine.get_event`` and an engine
looking for the cancels other processes marked on its runs all wait on the run store. Without
a word from the store they poll it (every second; every ``run_lease / 3`` for cancels), which
is what a signal sent from another process cost before. A store that supports wakes
(:class:`SupportsRunWakes`) rings after it stored a signal or an event, when a cancel mark
is written (:data:`CANCELS`), when a run is left pending with no owner (:data:`STARTS`:
recorded detached, reopened by an operator's retry, released by a closing engine; the engines
that reconcile take it over at once), when a debounced start is recorded (:data:`DEBOUNCED`),
when a schedule changes (:data:`SCHEDULES`), and when an
engine settles a run it took over from elsewhere (its id: a caller's ``engine.result`` in
another process returns at once, issue 30); every process with a waiter on that key wakes
within about a millisecond:

- memory: in-process only (every engine of a ``memory://`` backend shares the store);
- SQLite: a datagram to every process's socket in ``<file>.wakes/`` (the broker's doorbell
  mechanism, a folder of its own);
- Redis: ``PUBLISH`` (``SPUBLISH`` on a Cluster) on the namespace's channel
  ``{dt-runs:NS}:wakes``.

A wake is a hint, never the source of truth: the waiters keep their poll as a safety net, and
a lost wake (a killed process, a removed socket, a dropped subscription) costs at most one
poll period. A waiter takes its event (:meth:`RunWakes.watching`) BEFORE it reads the store,
so a ring between its read and its wait is not lost.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import trio
from trio_util import wait_any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

__all__ = [
    "CANCELS",
    "DEBOUNCED",
    "SCHEDULES",
    "STARTS",
    "STEPS",
    "RunWakes",
    "SupportsRunWakes",
    "first_of",
    "following",
    "ring",
    "step_key",
    "wakes_of",
]

#: The key rung when a cancel mark is written on any run of the namespace (its owner looks).
CANCELS = "\x00cancels"

#: The key rung when a run was left for an engine's reconcile to take over (a detached start,
#: an operator's retry, a closing engine's release; from any process): the engines that
#: reconcile look at once, not at their next tick.
STARTS = "\x00starts"

#: The key rung when a debounced start was recorded (a new one, not one folded into a pending
#: start): every engine's debounced-starts loop reads when it is due, and sleeps until then.
DEBOUNCED = "\x00debounced"

#: The key rung when a schedule was added, changed, paused, resumed or deleted (from any
#: process: the CLI, the console): every engine's scheduler reads the schedules again now.
SCHEDULES = "\x00schedules"

#: The prefix of the key rung when an engine applied a step result of a run it does not drive
#: (the engine that drives it re-reads that run's waited checkpoints: see :func:`step_key`).
STEPS = "\x00step:"


def step_key(run_id: str) -> str:
    """The key rung when a step result of ``run_id`` was applied by an engine that does not
    drive the run (several engines: any of them applies any result)."""
    return STEPS + run_id


class _Entry:
    __slots__ = ("event", "waiters")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.waiters = 0


class RunWakes:
    """One store's waiters in this process, by key (a run id, or :data:`CANCELS`).

    Args:
        listen: called (in Trio) when a waiter starts watching: the store starts, or checks,
            what carries other processes' rings here (a store without one passes ``None``).
    """

    def __init__(self, listen: Callable[[], None] | None = None) -> None:
        self._entries: dict[str, _Entry] = {}
        self._listen = listen
        self._followers: list[Callable[[str | None], None]] = []
        self.woken = 0
        """Rings that found a waiter (statistics)."""

    @contextmanager
    def watching(self, key: str) -> Iterator[trio.Event]:
        """The event the next ring of ``key`` sets, while the block runs (take it before
        reading the store). Entries go with their last waiter: nothing grows with old runs."""
        if self._listen is not None:
            self._listen()
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        entry.waiters += 1
        try:
            yield entry.event
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and self._entries.get(key) is entry:
                del self._entries[key]

    def follow(self, follower: Callable[[str | None], None]) -> Callable[[], None]:
        """Call ``follower(key)`` for every key rung from now on (``None``: rings may have been
        lost), whether or not someone watches it; returns the call that stops it. For a loop
        that cares about many keys at once (the engine's step watch)."""
        if self._listen is not None:
            self._listen()
        self._followers.append(follower)
        return lambda: self._followers.remove(follower)

    def wake(self, keys: Iterable[str] | None) -> None:
        """Wake the waiters of ``keys`` (``None``: every waiter: rings may have been lost)."""
        if self._followers:
            keys = None if keys is None else list(keys)
            for follower in list(self._followers):
                for key in keys if keys is not None else [None]:
                    follower(key)
        if keys is None:
            entries = list(self._entries.values())
            self._entries.clear()
        else:
            entries = [e for key in keys if (e := self._entries.pop(key, None)) is not None]
        for entry in entries:
            self.woken += 1
            entry.event.set()

    @property
    def waiting(self) -> int:
        """Keys watched now."""
        return len(self._entries)


@runtime_checkable
class SupportsRunWakes(Protocol):
    """A run store that rings its waiters, in every process (see the module docstring)."""

    wakes: RunWakes

    async def ring(self, key: str) -> None:
        """Wake the waiters of ``key`` here and in every other process (best-effort: never
        raises for a ring that could not be carried)."""
        ...


def wakes_of(store: object) -> RunWakes | None:
    """``store.wakes`` if ``isinstance(store, SupportsRunWakes)``, else ``None`` (on every run
    and every ``engine.result``, issue 32). On Python 3.11 that ``isinstance`` walks the
    protocol's members on every call (tens of microseconds): its same test is made here
    directly (each member present, ``ring`` not ``None``); later versions cache it."""
    if sys.version_info >= (3, 12):
        return store.wakes if isinstance(store, SupportsRunWakes) else None
    if hasattr(store, "wakes") and getattr(store, "ring", None) is not None:
        wakes: RunWakes = store.wakes
        return wakes
    return None


async def ring(store: object, key: str) -> None:
    """Ring ``key`` on ``store`` if it is a store that rings (:class:`SupportsRunWakes`); on
    one that does not, nothing (its waiters poll)."""
    if wakes_of(store) is not None:
        await cast("SupportsRunWakes", store).ring(key)


@contextmanager
def following(store: object, key: str, callback: Callable[[], None]) -> Iterator[bool]:
    """While the block runs, ``callback()`` at every ring of ``key``, and whenever rings may
    have been lost; yields whether ``store`` rings at all (``False``: no call ever comes)."""
    wakes = wakes_of(store)
    if wakes is None:
        yield False
        return

    def follower(rung: str | None) -> None:
        if rung is None or rung == key:
            callback()

    stop = wakes.follow(follower)
    try:
        yield True
    finally:
        stop()


async def first_of(*events: trio.Event) -> None:
    """Return once any of ``events`` is set (bound the wait with a cancel scope): at once,
    after one checkpoint, if one is set already; else ``trio_util.wait_any`` of their waits."""
    for event in events:
        if event.is_set():
            await trio.lowlevel.checkpoint()
            return
    await wait_any(*(event.wait for event in events))
