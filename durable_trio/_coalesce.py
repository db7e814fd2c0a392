"""Coalescing: calls made while a call is in flight share the next broker call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

import trio

from ._errors import BrokerError, BrokerUnavailable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["Coalescer"]

T = TypeVar("T")
R = TypeVar("R")


class _Batch(Generic[T, R]):
    __slots__ = ("done", "error", "go", "items", "results")

    def __init__(self) -> None:
        self.items: list[T] = []
        self.go = trio.Event()  # the call before it landed: its first member calls now
        self.done = trio.Event()
        self.results: list[R] = []
        self.error: BaseException | None = None


class Coalescer(Generic[T, R]):
    """Submit items one by one; they reach the broker through ``call(items) -> results`` (one
    result per item, in order), one call at a time per coalescer.

    Nagle's rule without the delay: an item submitted while no call is in flight goes out at
    once, alone (an idle system pays no latency for batching); items submitted while a call is
    in flight wait for it and then leave together, in ONE call, led by the first of them. Under
    load that turns N finalizes into one script run on Redis, one transaction on SQLite.

    Cancellation:
        A member cancelled while it waits leaves its item in its batch (it is sent anyway, like
        a write already handed to a socket). The leader of a queued batch leads it to the end,
        shielded: the others depend on it. A call that fails makes every member of its batch
        fail; an idle leader cancelled during its own call fails only itself.
    """

    def __init__(self, call: Callable[[list[T]], Awaitable[list[R]]]) -> None:
        self._call = call
        self._busy = False
        self._next: _Batch[T, R] | None = None

    @property
    def idle(self) -> bool:
        """No call in flight and none waiting: dropping this coalescer loses nothing."""
        return not self._busy and self._next is None

    async def submit(self, item: T) -> R:
        if not self._busy:
            batch: _Batch[T, R] = _Batch()
            batch.items.append(item)
            return await self._lead(batch, 0)
        batch = self._next if self._next is not None else self._open_next()
        index = len(batch.items)
        batch.items.append(item)
        if index == 0:
            # Others depend on this leader: it leads to the end even if cancelled meanwhile
            # (the call is bounded by the broker's own timeouts).
            with trio.CancelScope(shield=True):
                await batch.go.wait()
                return await self._lead(batch, 0)
        await batch.done.wait()
        if batch.error is not None:
            raise BrokerError(f"a coalesced broker call failed: {batch.error}") from batch.error
        return batch.results[index]

    def _open_next(self) -> _Batch[T, R]:
        self._next = _Batch()
        return self._next

    async def _lead(self, batch: _Batch[T, R], index: int) -> R:
        self._busy = True
        if self._next is batch:
            self._next = None  # closed: later items form the batch after this one
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
            batch.done.set()
            following = self._next
            if following is not None:
                following.go.set()  # its leader takes the broker now
            else:
                self._busy = False
        return batch.results[index]


def results_of(count: int, value: Any = None) -> list[Any]:
    """``count`` copies of ``value`` (for calls that answer nothing per item)."""
    return [value] * count
