"""Coalescing: calls made while a call is in flight share the next broker call."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import trio

from ._errors import BrokerError, BrokerUnavailable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["Coalescer"]

T = TypeVar("T")
R = TypeVar("R")

#: Calls in flight at most with ``most`` (two halves: see ``Coalescer``).
_MOST_IN_FLIGHT: Final = 2


class _Flag:
    """A one-shot event (``trio.Event``'s ``wait`` and ``set``, for the tasks of one batch):
    two per batch, on the path of every finalize, so kept to a list of the tasks waiting."""

    __slots__ = ("_tasks", "is_set")

    def __init__(self) -> None:
        self.is_set = False
        self._tasks: list[trio.lowlevel.Task] = []

    async def wait(self) -> None:
        if self.is_set:
            await trio.lowlevel.checkpoint()
            return
        task = trio.lowlevel.current_task()
        tasks = self._tasks
        tasks.append(task)

        def abort(_: object) -> trio.lowlevel.Abort:
            tasks.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def hand_to(self, other: _Flag) -> None:
        """The tasks waiting here wait for ``other`` instead (each then returns from its
        ``wait`` here when ``other`` is set). Only for waits that cannot be cancelled (a
        shielded leader's): a cancelled wait's abort would look for its task here."""
        other._tasks.extend(self._tasks)
        self._tasks = []
        self.is_set = True

    def set(self) -> None:
        if self.is_set:
            return
        self.is_set = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            trio.lowlevel.reschedule(task)


class _Batch(Generic[T, R]):
    __slots__ = ("done", "error", "go", "items", "results")

    def __init__(self) -> None:
        self.items: list[T] = []
        self.go = _Flag()  # the call before it landed: its first member calls now
        self.done = _Flag()
        self.results: list[R] = []
        self.error: BaseException | None = None


class Coalescer(Generic[T, R]):
    """Submit items one by one; they reach the broker through ``call(items) -> results`` (one
    result per item, in order), one call at a time per coalescer (two with ``most``).

    Nagle's rule without the delay: an item submitted while no call is in flight goes out at
    once, alone (an idle system pays no latency for batching); items submitted while a call is
    in flight wait for it and then leave together, in ONE call, led by the first of them. Under
    load that turns N finalizes into one script run on Redis, one transaction on SQLite.

    Two halves (``most``, a callable read at each submit): a batch holds at most ``most()``
    items, and a full one goes out at once even while a call is in flight (two in flight at
    most; a batch not full still waits for the broker to be idle), led by the member that
    filled it, in its own turn: waking the first member to lead it would send it one pass of
    the scheduler later, by when the other half's jobs have run too and both halves leave
    together, then wait together (docs/decisions.md, "The member that fills a batch leads
    it"). Under load the work then splits into two batches that alternate: one at the broker
    while the other's jobs run.
    Without it, one batch at the broker while the next fills leaves the process idle for the
    whole broker call and the broker idle while the jobs run; and the batches settle unequal
    (one job, then all the others), so neither side's wait shrinks.

    A batch not full waits for the broker to be idle, or for the process to be: batching pays
    only while the process has other work to do, so when Trio's scheduler runs out of runnable
    tasks (it is about to wait for I/O or, under a virtual clock, to jump it) with one call in
    flight, the oldest batch waiting goes as the second. Where the jobs themselves wait on I/O
    (a step's body sending a command), the process otherwise sleeps while the batch of the
    jobs already done waits for the call in flight (docs/decisions.md, "A batch not full goes
    when the process runs out of work").

    Cancellation:
        A member cancelled while it waits leaves its item in its batch (it is sent anyway, like
        a write already handed to a socket). The leader of a queued batch (its first member,
        or the one that filled it) leads it to the end, shielded: the others depend on it; a
        first member that did not lead waits for the answer shielded too. A call that fails
        makes every member of its batch fail; an idle leader cancelled during its own call
        fails only itself.
    """

    def __init__(
        self,
        call: Callable[[list[T]], Awaitable[list[R]]],
        *,
        most: Callable[[], int] | None = None,
    ) -> None:
        self._call = call
        self._most = most
        self._in_flight = 0
        #: Batches waiting, oldest first (more than one only with ``most``); a batch leaves
        #: this queue when it is released, so no item joins a batch already on its way.
        self._queued: collections.deque[_Batch[T, R]] = collections.deque()
        self._held = False  # listed with this run's _IdleRelease

    @property
    def idle(self) -> bool:
        """No call in flight and none waiting: dropping this coalescer loses nothing."""
        return not self._in_flight and not self._queued

    def _full(self, batch: _Batch[T, R]) -> bool:
        return self._most is not None and len(batch.items) >= max(1, self._most())

    async def submit(self, item: T) -> R:
        if not self._in_flight and not self._queued:
            batch: _Batch[T, R] = _Batch()
            batch.items.append(item)
            self._in_flight += 1
            return await self._lead(batch, 0)
        queued = self._queued
        if queued and not self._full(queued[-1]):
            batch = queued[-1]
        else:
            batch = _Batch()
            queued.append(batch)
        index = len(batch.items)
        batch.items.append(item)
        if self._in_flight < _MOST_IN_FLIGHT and queued[0] is batch and self._full(batch):
            if index:
                # Full: it need not wait for the call in flight, nor for its first member to
                # be scheduled: the member that filled it leads it now (a pass sooner), and
                # the first member waits for its result as any other.
                self._in_flight += 1
                queued.popleft()
                batch.go.hand_to(batch.done)
                with trio.CancelScope(shield=True):
                    return await self._lead(batch, index)
            self._release()
        else:
            self._hold()
        if index == 0:
            # Others depend on this leader: it leads to the end even if cancelled meanwhile
            # (the call is bounded by the broker's own timeouts).
            with trio.CancelScope(shield=True):
                await batch.go.wait()
                if not batch.done.is_set:
                    return await self._lead(batch, 0)
        else:
            await batch.done.wait()
        if batch.error is not None:
            # A transient failure stays one for every item of the batch: a follower's finalize
            # is tried again like its leader's (a Redis out of memory, an unreachable SQLite
            # file), not left to the reclaim sweep.
            kind = BrokerUnavailable if isinstance(batch.error, BrokerUnavailable) else BrokerError
            raise kind(f"a coalesced broker call failed: {batch.error}") from batch.error
        return batch.results[index]

    def _hold(self) -> None:
        """A batch waits: with ``most``, let it go if the process runs out of work first."""
        if self._most is not None and not self._held:
            self._held = True
            _IdleRelease.get().hold(self)

    def _release_idle(self) -> bool:
        """The process ran out of work: the oldest batch waiting goes now, full or not, unless
        two calls fly already. Returns whether one went."""
        self._held = False
        if not self._queued or self._in_flight >= _MOST_IN_FLIGHT:
            return False  # (listed again by ``_lead`` when a call lands)
        self._release()
        if self._queued:
            self._hold()  # the next one, at the next pass that finds no work
        return True

    def _release(self) -> None:
        """The oldest waiting batch goes: closed (later items form the batches after it) and
        counted in flight from now, before its leader runs."""
        self._in_flight += 1
        self._queued.popleft().go.set()  # its leader takes the broker now

    async def _lead(self, batch: _Batch[T, R], index: int) -> R:
        try:
            batch.results = await self._call(batch.items)
        except BaseException as exc:
            batch.error = (
                BrokerUnavailable("the coalesced broker call was cancelled")
                if isinstance(exc, trio.Cancelled)
                else exc
            )
            raise
        finally:
            self._in_flight -= 1
            batch.done.set()
            if self._queued and (not self._in_flight or self._full(self._queued[0])):
                self._release()
            if self._queued:
                self._hold()
        return batch.results[index]


class _IdleRelease(trio.abc.Instrument):
    """Releases the batches coalescers hold back when Trio's scheduler runs out of work.

    One per ``trio.run`` (a :class:`~trio.lowlevel.RunVar`), installed as an instrument on
    first use: its ``before_io_wait`` runs once per pass of the scheduler, after every task
    that was runnable has run. When no task is runnable then (the loop is about to sleep, or
    a virtual clock to jump), each coalescer listed releases its oldest waiting batch.
    """

    def __init__(self) -> None:
        self._held: list[Coalescer[Any, Any]] = []
        # With Trio's own clock a pass that will not sleep has tasks to run; another clock (a
        # MockClock autojumping) sleeps 0 s when idle, so there the scheduler is asked (the
        # count costs a few microseconds: not on every pass of a real run).
        self._ask = type(trio.lowlevel.current_clock()).__name__ != "SystemClock"

    @classmethod
    def get(cls) -> _IdleRelease:
        try:
            return _IDLE_RELEASE.get()
        except LookupError:
            release = cls()
            _IDLE_RELEASE.set(release)
            trio.lowlevel.add_instrument(release)
            return release

    def hold(self, coalescer: Coalescer[Any, Any]) -> None:
        """``coalescer`` holds a batch back: release it if the process runs out of work."""
        self._held.append(coalescer)

    def before_io_wait(self, timeout: float) -> None:
        held = self._held
        if not held or (
            timeout <= 0
            and (not self._ask or trio.lowlevel.current_statistics().tasks_runnable)
        ):
            return
        self._held = []
        released = False
        for coalescer in held:
            released = coalescer._release_idle() or released
        if released and timeout > 0:
            # A leader was made runnable after the loop chose to sleep: wake the loop up.
            trio.lowlevel.current_trio_token().run_sync_soon(_nothing, idempotent=True)


def _nothing() -> None:
    pass


_IDLE_RELEASE: Final = trio.lowlevel.RunVar[_IdleRelease]("durable_trio_idle_release")


def results_of(count: int, value: Any = None) -> list[Any]:
    """``count`` copies of ``value`` (for calls that answer nothing per item)."""
    return [value] * count
